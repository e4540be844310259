"""Deterministic prompts of a given size, each with its own random first line.

Layout: ``<random prefix line>\\n<filler words>\\n\\n<instruction>``. The prefix comes from an
``random.Random`` the caller passes, so a run is reproducible from its seed, yet two cold prompts
never share their first tokens: vLLM's prefix cache hashes blocks from the start of the prompt,
so a different first line means no block can be reused (the seeds: "每个上下文长度用独立随机文本").
A warm run sends the same ``Prompt`` again. The filler is the same fixed word sequence for every
prompt; only its length changes.

Sizes are counted with vLLM's ``/tokenize`` when the server has it (exact for the model's
tokenizer, without the chat template's few tokens); otherwise they are estimated and the
``Prompt`` says so. The server's ``usage.prompt_tokens`` is what the results use either way.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from vfleet.measure.client import BenchError, Client

# Common English words: one token each (with the leading space) in the BPE vocabularies of the
# models vfleet serves, so a word count maps to a token count almost linearly.
_WORD_TEXT = """
    the of and to in is was for on are with as his they be at one have this from or had by
    word but what some we can out other were all there when up use your how said an each she
    which do their time if will way about many then them write would like so these her long
    make thing see him two has look more day could go come did number sound no most people my
    over know water than call first who may down side been now find any new work part take get
    place made live where after back little only round man year came show every good me give
    our under name very through just form sentence great think say help low line differ turn
    cause much mean before move right boy old too same tell does set three want air well also
    play small end put home read hand port large spell add even land here must big high such
    follow act why ask men change went light kind off need house picture try us again animal
    point mother world near build self earth father head stand own page should country found
    answer school grow study still learn plant cover food sun four between state keep eye never
    last let thought city tree cross farm hard start might story saw far sea draw left late run
    while press close night real life few north open seem together next white children begin
    got walk example ease paper group always music those both mark often letter until mile river
    car feet care second book carry took science eat room friend began idea fish mountain stop
    once base hear horse cut sure watch color face wood main enough plain girl usual young ready
    above ever red list though feel talk bird soon body dog family direct pose leave song measure
    door product black short numeral class wind question happen complete ship area half rock
    order fire south problem piece told knew pass since top whole king space heard best hour
    better true during hundred five remember step early hold west ground interest reach fast
"""
WORDS = tuple(_WORD_TEXT.split())

# The task of every prompt: free writing, long enough for ~800-1000 tokens of decode (seed 001
# used "write a ~1500-character explanatory text"; MTP acceptance depends on the task).
INSTRUCTION = (
    "Ignore the notes above. Write a detailed explanatory essay of about 1500 words on how a "
    "bicycle works: the frame, the wheels, the drive train, the brakes and the gears. Use plain "
    "prose with several paragraphs."
)

FILLER_SEED = 20261129
ESTIMATED_TOKENS_PER_WORD = 1.12  # the word list above plus sentence punctuation, typical BPE
SAMPLE_WORDS = 2000  # words tokenized once to learn the tokens-per-word ratio

_filler: list[str] = []


def filler(n_words: int) -> str:
    """The first ``n_words`` words of one fixed pseudo-text (sentences of 12 words)."""
    if n_words <= 0:
        return ""
    if len(_filler) < n_words:
        rng = random.Random(FILLER_SEED)
        words = [rng.choice(WORDS) for _ in range(max(n_words, 2 * len(_filler), 4096))]
        # Word j's form depends on j only, so a longer filler starts with every shorter one.
        for i in range(0, len(words), 12):
            words[i] = words[i].capitalize()
            if i + 11 < len(words):
                words[i + 11] += "."
        _filler[:] = words
    return " ".join(_filler[:n_words])


def random_prefix(rng: random.Random) -> str:
    """A first line no other prompt has: 64 random bits in hex, then eight random words."""
    words = " ".join(rng.choice(WORDS) for _ in range(8))
    return f"Session {rng.getrandbits(64):016x}: {words}."


@dataclass(frozen=True)
class Prompt:
    text: str
    target_tokens: int
    tokens: int  # counted by /tokenize, or estimated (see ``estimated``)
    estimated: bool


Counter = Callable[[str], int]


def vllm_counter(client: Client, model: str, timeout: float = 60.0) -> Counter | None:
    """Token counting with vLLM's POST /tokenize, or None if the server does not offer it."""

    def count(text: str) -> int:
        data = client.request_json(
            "POST", "/tokenize", {"model": model, "prompt": text}, timeout=timeout
        )
        n = data.get("count") if isinstance(data, dict) else None
        if not isinstance(n, int):
            raise BenchError("protocol", f"/tokenize answered without a count: {data!r:.200}")
        return n

    try:
        count("hello")
    except BenchError:
        return None
    return count


class PromptBuilder:
    def __init__(self, count: Counter | None, instruction: str = INSTRUCTION) -> None:
        self.count = count
        self.instruction = instruction
        self._per_word: float | None = None

    @property
    def estimated(self) -> bool:
        return self.count is None

    def per_word(self) -> float:
        if self._per_word is None:
            if self.count is None:
                self._per_word = ESTIMATED_TOKENS_PER_WORD
            else:
                self._per_word = self.count(filler(SAMPLE_WORDS)) / SAMPLE_WORDS
        return self._per_word

    def _measure(self, text: str) -> int:
        if self.count is not None:
            return self.count(text)
        # ~4 characters per token for English prose; the filler's ratio is known better.
        return max(1, round(len(text) / 4))

    def _text(self, prefix: str, n_words: int) -> str:
        body = filler(n_words)
        return "\n".join(
            [prefix, body, "", self.instruction] if body else [prefix, self.instruction]
        )

    def build(self, target_tokens: int, rng: random.Random) -> Prompt:
        """A prompt of about ``target_tokens`` tokens (at least the prefix and instruction)."""
        prefix = random_prefix(rng)
        text = self._text(prefix, 0)
        base = self._measure(text)
        if target_tokens <= base:
            return Prompt(text, target_tokens, base, self.estimated)
        if self.count is None:
            n_words = round((target_tokens - base) / self.per_word())
            text = self._text(prefix, n_words)
            return Prompt(text, target_tokens, base + round(n_words * self.per_word()), True)
        # Two corrections land within a few tokens: the ratio is nearly constant.
        per_word = self.per_word()
        n_words = max(1, round((target_tokens - base) / per_word))
        tokens = base
        for _ in range(3):
            text = self._text(prefix, n_words)
            tokens = self._measure(text)
            error = target_tokens - tokens
            if abs(error) <= max(4, target_tokens // 200):
                break
            n_words = max(1, n_words + round(error / per_word))
        return Prompt(text, target_tokens, tokens, False)
