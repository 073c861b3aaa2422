"""Loading a user's environment file (env.path) into an EnvFactory that starts episodes.

    load_environment(cfg, tokenizer, stop_ids=()) -> EnvFactory | None   (None when env.path is "")

The form is told apart as docs/agents.md says: env.tools names functions (the built-in
tool-calling environment); else the class env.name, or the only class of the file with reset and
step (gym-style), or the only class with reset and public methods (TRL's environment_factory).
Every mistake found here is an EnvLoadError, one line naming the file and what to do, before any
episode starts: a missing file, a syntax error, no such class or function, several candidates, a
tool without type hints or docstring, reset/step signatures that cannot be called, a reward
setting the environment cannot give.
"""

from __future__ import annotations

import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable

from rl.agent import tools as T
from rl.agent.calls import one_line
from rl.agent.config import EnvConfig, EnvLoadError
from rl.agent.envs import GymSession, ToolSession
from rl.agent.episode import Episode
from rl.agent.render import Renderer
from rl.reward.reward_fn import import_user_file


class EnvFactory:
    """Starts episodes of one loaded environment; owns the thread pool its sync code runs in.

    form: "gym", "tools" or "trl" (TRL's environment_factory class);
    reward_mode: env | function | sum (EnvConfig.reward);
    uses_function: the reward node's function scores the final chat (function, sum).
    """

    def __init__(self, cfg: EnvConfig, tokenizer: Any, renderer: Renderer, session: Callable,
                 form: str, tool_schemas: list[dict], stop_ids: tuple[int, ...] = ()):
        self.cfg, self.tokenizer, self.renderer, self.form = cfg, tokenizer, renderer, form
        self.tool_schemas = tool_schemas
        """The tools' OpenAI function schemas ([] for a gym-style class)."""
        self._session = session
        self.reward_mode = cfg.reward
        self.uses_function = cfg.reward in ("function", "sum")
        ends = {renderer.end_of_turn_id, getattr(tokenizer, "eos_token_id", None), *stop_ids}
        self.stop_ids = frozenset(i for i in ends if i is not None)
        """Ids a turn may end on: stripped from the assistant's text (they stay in the tokens)."""
        self.executor = ThreadPoolExecutor(cfg.threads, thread_name_prefix="env")

    def episode(self, row: dict) -> Episode:
        """One episode on a data row: its fields, the prompt as `prompt` (a text or messages)."""
        return Episode(self, self._session(), dict(row))

    def close(self) -> None:
        """Stop the pool (threads of hung calls are left to finish on their own)."""
        self.executor.shutdown(wait=False, cancel_futures=True)


def load_environment(cfg: EnvConfig, tokenizer: Any, stop_ids: tuple[int, ...] | list[int] = ()) -> EnvFactory | None:
    """The factory of env.path's episodes (None without one), every mistake an EnvLoadError.
    `tokenizer` renders the chats (its chat template); `stop_ids`: the generator's stop tokens."""
    if not cfg.path:
        if cfg.tools or cfg.name:
            raise EnvLoadError("env.tools / env.name are set but env.path is empty; set env.path=FILE")
        return None
    in_template = T.template_has_tools(tokenizer)
    form, session, schemas = _resolve(cfg, in_template)
    try:
        renderer = Renderer(tokenizer, schemas if in_template else None, cfg.non_append_template == "keep")
    except ValueError as e:
        raise EnvLoadError(f"{cfg.path}: {e}") from None
    except Exception as e:           # the template raised on a user/assistant chat
        raise EnvLoadError(f"{cfg.path}: the chat template cannot render a user/assistant chat: "
                           f"{one_line(e)}") from None
    return EnvFactory(cfg, tokenizer, renderer, session, form, schemas, tuple(stop_ids))


def environment_problems(cfg: EnvConfig) -> list[str]:
    """load_environment's checks that need no tokenizer (the file's form, signatures, tool schemas,
    the reward setting), run by the driver before Ray starts (GeneratorConfig.preflight): [] or one line.
    A missing file is the setting's own check (ExistingPath), not repeated here."""
    if not cfg.path or not os.path.isfile(cfg.path):
        return []
    try:
        _resolve(cfg, in_template=False)
    except EnvLoadError as e:
        return [str(e)]
    return []


def _resolve(cfg: EnvConfig, in_template: bool) -> tuple[str, Callable, list[dict]]:
    """(form, the session factory, the tool schemas) of env.path, every mistake an EnvLoadError.
    Imports the file (as the reward file is imported to check it)."""
    path = cfg.path
    module = import_user_file(path, "environment", EnvLoadError)
    classes = {k: v for k, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module.__name__}
    if cfg.tools:
        if cfg.name or cfg.kwargs:
            raise EnvLoadError(f"{path}: env.tools names functions; env.name / env.kwargs are for a class: "
                               "set one form, not both")
        fns = {name: _tool_function(module, name, path) for name in cfg.tools}
        schemas = [T.tool_schema(fn, f"{path}: tool {name}") for name, fn in fns.items()]
        form, session = "tools", partial(ToolSession, fns, schemas, in_template)
    else:
        cls = _pick_class(classes, cfg.name, path, vars(module))
        if callable(getattr(cls, "step", None)):
            _check_signatures(cls, path)
            form, schemas = "gym", []
            session = partial(GymSession, cls, dict(cfg.kwargs))
            if cfg.isolate:
                from rl.agent.isolated_env import IsolatedGymSession
                in_file = cfg.name or next(k for k, v in classes.items() if v is cls)
                session = partial(IsolatedGymSession, cls, dict(cfg.kwargs), os.path.abspath(path),
                                  cfg.step_timeout_s, in_file)
        else:
            methods = T.method_tools(cls)
            schemas = [T.method_schema(cls, name, fn, path) for name, fn in methods.items()]
            form = "trl"
            session = partial(ToolSession, methods, schemas, in_template, cls, dict(cfg.kwargs))
    if cfg.isolate and form != "gym":
        raise EnvLoadError(f"{path}: env.isolate=true runs a gym-style class (reset and step) in its own process; "
                           f"this file's form is {form}")
    _check_reward(cfg, form, path, None if cfg.tools else cls)
    return form, session, schemas


def _tool_function(module, name: str, path: str) -> Callable:
    fn = getattr(module, name, None)
    if fn is None or inspect.isclass(fn) or not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_")
                         and v.__module__ == module.__name__)
        raise EnvLoadError(f"{path}: no function named {name!r} (env.tools); it defines {defined or 'no functions'}")
    return fn


def _pick_class(classes: dict[str, type], name: str, path: str, namespace: dict) -> type:
    if name:
        cls = namespace.get(name)
        if not inspect.isclass(cls):
            raise EnvLoadError(f"{path}: no class named {name!r} (env.name); it defines classes "
                               f"{sorted(classes) or 'none'}")
        if not callable(getattr(cls, "reset", None)):
            raise EnvLoadError(f"{path}: class {name} has no reset method; an environment class defines "
                               "reset(**row) and step(action), or reset and tool methods (TRL's form)")
        return cls
    resettable = {k: c for k, c in classes.items() if callable(getattr(c, "reset", None))}
    gym = sorted(k for k, c in resettable.items() if callable(getattr(c, "step", None)))
    trl = sorted(k for k, c in resettable.items() if T.method_tools(c))
    for found, what in ((gym, "reset and step"), (trl, "reset and public tool methods")):
        if len(found) > 1:
            raise EnvLoadError(f"{path}: several classes have {what}: {', '.join(found)}; "
                               f"choose one with env.name={found[0]}")
        if found:
            return classes[found[0]]
    raise EnvLoadError(f"{path}: no environment class (reset(**row) and step(action), or reset and tool methods) "
                       f"and no env.tools; it defines classes {sorted(classes) or 'none'}")


def _check_signatures(cls: type, path: str) -> None:
    """reset(**row) must take keyword arguments only; step(action) one positional argument."""
    for method, want in (("reset", "reset(self, **row)"), ("step", "step(self, action)")):
        fn = getattr(cls, method)
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue                            # a builtin: nothing to check
        self_arg = (None,) if inspect.isfunction(inspect.getattr_static(cls, method)) else ()
        try:
            if method == "step":
                sig.bind(*self_arg, "action")
            else:
                sig.bind_partial(*self_arg)
                params = list(sig.parameters.values())[len(self_arg):]
                if any(p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in params):
                    raise TypeError("it has required positional-only arguments")
        except TypeError as e:
            raise EnvLoadError(f"{path}: {cls.__name__}.{method}{sig} cannot be called as {want} ({e}); "
                               f"define {want}") from None


def _check_reward(cfg: EnvConfig, form: str, path: str, cls: type | None) -> None:
    gives = form == "gym" or callable(getattr(cls, "get_reward", None))
    if cfg.reward in ("env", "sum") and not gives:
        what = "tool functions give" if form == "tools" else f"class {cls.__name__} has no get_reward() and gives"
        raise EnvLoadError(f"{path}: env.reward={cfg.reward}, but {what} no reward; set env.reward=function "
                           "(the reward node's function scores the final chat)" +
                           ("" if form == "tools" else " or define get_reward(self) -> float"))
