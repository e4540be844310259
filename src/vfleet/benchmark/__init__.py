"""`vfleet bench`: measure a vLLM server the way the seed write-ups did.

Modules: ``client`` (streaming OpenAI client, timed), ``prompts`` (sized prompts with unique
prefixes), ``stats`` (fits, noise, comparison), ``scenarios`` (what is run), ``report`` (JSON,
markdown, plots), ``cli`` (the command). Importing the package loads none of them, so neither
matplotlib nor vfleet_healthcheck is paid for by other commands.
"""
