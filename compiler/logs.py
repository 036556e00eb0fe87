"""``DPAR_LOGS``: the passes' decisions on stderr during a real run, and in torch's structured trace.

``DPAR_LOGS`` works like ``TORCH_LOGS``: a comma-separated list of channels,
``+channel`` for debug detail, ``all`` for every channel. The same decisions go
to ``torch._logging.trace_structured`` as artifacts, so ``TORCH_TRACE=dir``
followed by ``tlparse`` shows them next to Dynamo's own.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence


from dpar.compiler.collectives import Collective
from dpar.core.torch_internals import structured_trace_on, trace_structured

CHANNELS: dict[str, str] = {
    "dpar": "dpar",  # the backend's own messages (bucket plans)
    "passes": "dpar.passes",  # op-count diff per pass
    "graphs": "dpar.graphs",  # graph code after every pass (debug detail at +graphs)
    "collectives": "dpar.collectives",  # the collective table of every compiled graph
}
ENV = "DPAR_LOGS"

passes_log = logging.getLogger(CHANNELS["passes"])
graphs_log = logging.getLogger(CHANNELS["graphs"])
collectives_log = logging.getLogger(CHANNELS["collectives"])

_configured: str | None = None


def parse(spec: str) -> dict[str, int]:
    """``"passes,+graphs"`` -> logger level per channel; raises on unknown names."""
    levels = {name: logging.WARNING for name in CHANNELS}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        level = logging.DEBUG if item.startswith("+") else logging.INFO
        name = item.lstrip("+")
        if name == "all":
            levels = {n: level for n in CHANNELS}
        elif name in CHANNELS:
            levels[name] = level
        else:
            raise ValueError(f"{ENV}: unknown channel {name!r}; valid: all, {', '.join(CHANNELS)}")
    return levels


def configure(spec: str | None = None) -> None:
    """Apply ``spec`` (default: the ``DPAR_LOGS`` variable); a no-op when neither is set."""
    global _configured
    spec = os.environ.get(ENV) if spec is None else spec
    if not spec or spec == _configured:
        return
    root = logging.getLogger("dpar")
    if not any(getattr(h, "_dpar_logs", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        handler._dpar_logs = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False
    for name, level in parse(spec).items():
        logging.getLogger(CHANNELS[name]).setLevel(level)
    _configured = spec


def graph_code_logged() -> bool:
    """Whether a pass's graph code would be printed (``+graphs``) or traced (``TORCH_TRACE``)."""
    return graphs_log.isEnabledFor(logging.DEBUG) or structured_trace_on()


def artifact(name: str, payload: Callable[[], str], *, encoding: str = "string") -> None:
    """One structured-trace artifact (built only when a trace is being written)."""
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"dpar_{name}", "encoding": encoding},
        payload_fn=payload,
    )


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")


def log_pass(label: str, pass_name: str, before: dict[str, int], after: dict[str, int], code: str | None) -> None:
    """One pass's effect: which collective counts changed, and the graph it left (None: nobody asked for it)."""
    changed = [f"{k}: {before[k]} -> {after[k]}" for k in after if before.get(k) != after[k]]
    passes_log.info("%s: %s: %s", label, pass_name, ", ".join(changed) or "no collective change")
    if code is not None:
        graphs_log.debug("%s after %s:\n%s", label, pass_name, code)
        artifact(f"{_slug(label)}_after_{pass_name}", lambda: code)


def log_collectives(label: str, found: Sequence[Collective]) -> None:
    """The collectives of a graph about to be compiled, one line each."""
    configure()
    for i, c in enumerate(found):
        collectives_log.info(
            "%s #%d: %s bytes=%d issued by %s, waited by %s, %d compute nodes between",
            label, i, c.fingerprint(), c.bytes, c.issue_node, c.wait_node, c.compute_between,
        )
    if found:
        rows = [{**vars(c), "dtype": str(c.dtype)} for c in found]
        artifact(f"{_slug(label)}_collectives", lambda: json.dumps(rows), encoding="json")
