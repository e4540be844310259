"""Run a function on a module right after it is first imported, without importing it now.

A hook on vLLM's GPU model runner must not import that module at plugin load: every vLLM process
loads the plugin (the API server too, which never builds a runner), and the runner's import
pulls in most of vLLM's model executor. The worker imports it itself a moment after loading the
plugin (``v1/worker/worker_base.py`` ``init_worker``); this finder patches it then.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from .log import log


class _Once(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the real loader of one module name, once."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # before the lookup below, which asks sys.meta_path again
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _call(self.then, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _call(then: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        then(module)
    except Exception as exc:  # a hook that fails leaves the module as vLLM wrote it
        log(logging.WARNING, f"vfleet-sm75: hook on {module.__name__} failed: {exc!r}")


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """``then(module)`` now if ``name`` is imported already, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        _call(then, module)
        return
    sys.meta_path.insert(0, _Once(name, then))


def wrap_method(
    module_name: str,
    class_name: str,
    method: str,
    wrap: Callable[[Callable[..., object]], Callable[..., object]],
    flag: str,
) -> None:
    """``module_name.class_name.method = wrap(it)`` once the module is imported, once per class:
    ``flag`` marks the class, so that a second plugin load in one process wraps nothing twice."""

    def patch(module: ModuleType) -> None:
        cls = getattr(module, class_name)
        if getattr(cls, flag, False):
            return
        setattr(cls, method, wrap(getattr(cls, method)))
        setattr(cls, flag, True)

    when_imported(module_name, patch)
