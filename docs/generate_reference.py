"""Write docs/reference.md and docs/notes.md from the code: ``python docs/generate_reference.py``.

reference.md: the public names of ``dpar`` with their signatures, ``parallelize``'s options per strategy
(``ACCEPTS``), which strategies ``dpar.explain`` inspects, the compile options (``compiler/options.py``),
the ``dpar`` command's flags (its argparse parser), every error and warning class, every environment
variable the product code reads or sets, the device presets. notes.md: every ``[Note: ...]`` block and
where it is written. ``tests/test_docs.py`` regenerates both and fails when a committed page differs.
``--check`` exits 1 instead of writing.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("api", "compiler", "core", "runtime", "surgery", "inspection", "planner", "integrations")
NOTE_DIRS = (*PRODUCT, "examples", "benchmarks", "tests")
COMMAND = "python docs/generate_reference.py"

# Every environment variable the product code reads or sets, with what it does. A variable found in the
# code without an entry here stops the generator: say what it does before it ships.
ENVIRONMENT = {
    "DPAR_LOGS": "read at `import dpar` (and by `dpar.compiler.logs.configure`): comma-separated channels "
                 "`dpar`, `passes`, `graphs`, `collectives` or `all`; `+name` for debug detail. The same records "
                 "go to torch's structured trace (`TORCH_TRACE=dir`, then `tlparse`).",
    "WORLD_SIZE": "read to tell a launched job (`WORLD_SIZE > 1` without `init_process_group` is a "
                  "`ProcessGroupError`); `dpar.explain` hides a launcher's value while it simulates its own world.",
    "TORCHELASTIC_USE_AGENT_STORE": "read by the liveness watch to name who hosts the rendezvous store in a "
                                    "`RankLostError` (torchrun's agent or rank 0).",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "set to `3` at `import dpar` unless already set (a failed or timed-out NCCL "
                                       "collective ends the process without a clean-up that could hang). torchrun "
                                       "sets `1` for its workers, and that value wins.",
    "TORCH_NCCL_PROPAGATE_ERROR": "set to `1` at `import dpar` unless already set (other ranks learn of an NCCL "
                                  "error through the store instead of each waiting for its own timeout).",
    "TORCH_NCCL_ENABLE_MONITORING": "set to `1` at `import dpar` unless already set (a stuck NCCL watchdog thread "
                                    "is ended after `TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`).",
}
# Read only by the test suite (tests/), listed for completeness.
TEST_ENVIRONMENT = {
    "DPAR_FUZZ_EXAMPLES": "tests/test_fuzz_strategies.py: how many random models hypothesis draws.",
    "DPAR_FUZZ_SEED": "tests/test_fuzz_strategies.py: the draw's seed.",
    "DPAR_FUZZ_SHRINK": "tests/test_fuzz_strategies.py: `1` lets hypothesis shrink a failing model.",
    "CI": "`true`: tests that need torchtitan's model code fail instead of skipping when it is missing.",
}


def _first_line(obj: object) -> str:
    """The first paragraph of ``obj``'s own docstring (a class's, never one it inherits)."""
    own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    doc = inspect.cleandoc(own) if isinstance(own, str) else ""
    return " ".join(doc.split("\n\n")[0].split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _signature(fn: object) -> str:
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"
    return re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", sig)


def _public_api() -> list[str]:
    import dpar

    out = ["## `import dpar`", "", "`dpar.__all__`, as the code declares it.", ""]
    functions = [n for n in dpar.__all__ if inspect.isfunction(getattr(dpar, n))]
    classes = [n for n in dpar.__all__ if inspect.isclass(getattr(dpar, n))
               and not issubclass(getattr(dpar, n), BaseException | Warning)]
    modules = [n for n in dpar.__all__ if inspect.ismodule(getattr(dpar, n))]
    for name in functions:
        fn = getattr(dpar, name)
        out += [f"### `dpar.{name}`", "", "```python", f"{name}{_signature(fn)}", "```", "", _first_line(fn), ""]
    for name in classes:
        cls = getattr(dpar, name)
        out += [f"### `dpar.{name}`", "", "```python", f"class {name}{_signature(cls)}", "```", "", _first_line(cls), ""]
    for name in modules:
        module = getattr(dpar, name)
        out += [f"### `dpar.{name}`", "", _first_line(module), ""]
        for fn_name in getattr(module, "__all__", ()):
            fn = getattr(module, fn_name)
            out += ["```python", f"dpar.{name}.{fn_name}{_signature(fn)}", "```", "", _first_line(fn), ""]
    from dpar.planning import priced_on_graphs
    from dpar.planner.pipeline import plan_pipeline

    out += ["### Beside `dpar.__all__`", ""]
    for label, fn in (("dpar.planner.plan_pipeline", plan_pipeline), ("dpar.planning.priced_on_graphs", priced_on_graphs)):
        out += ["```python", f"{label}{_signature(fn)}", "```", "", _first_line(fn), ""]
    return out


def _integrations() -> list[str]:
    """Read from the source (importing transformers and lightning costs ~20 s)."""
    out = ["## `dpar.integrations`", "", "| class | module | constructor |", "|---|---|---|"]
    for path in sorted((ROOT / "integrations").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
                args = "(...)" if init is None else "(" + ast.unparse(init.args).removeprefix("self, ").removeprefix("self") + ")"
                out.append(f"| `{node.name}` | `dpar.integrations.{path.stem}` | `{_cell(args)}` |")
    return out + [""]


def _strategies() -> list[str]:
    from dpar.core.plan import Strategy
    from dpar.inspect.strategies import STRATEGIES as INSPECTED
    from dpar.placement import ACCEPTS

    names = [s.value for s in Strategy] + ["auto"]
    out = ["## Strategies: mesh, options, inspection", "",
           "`dpar.parallelize(model, strategy=...)`. Mesh axes and roles from `core/plan.py`; the options "
           "beyond `mesh`, `tp_plan`, `example_inputs`, `plan`, `memory_budget_gb` that a strategy takes "
           "from `ACCEPTS` in `api/placement.py` (any other strategy refuses them with an `OptionsError`); "
           "`bucket_cap_mb` and `max_inflight_gathers` are checked per strategy in `api/placement.py`; "
           "inspectable: a key of `STRATEGIES` in `inspection/strategies.py` (`dpar.explain`, `dpar inspect`).", "",
           "| strategy | mesh dims | axis roles | " + " | ".join(f"`{o}`" for o in ACCEPTS) + " | inspectable |",
           "|---|---|---|" + "---|" * len(ACCEPTS) + "---|"]
    for name in names:
        strategy = None if name == "auto" else Strategy(name)
        dims = "planned" if strategy is None else ", ".join(strategy.mesh_dim_names)
        roles = "planned" if strategy is None else ", ".join(r.value for r in strategy.roles)
        takes = ["yes" if name in ACCEPTS[o][0] else "" for o in ACCEPTS]
        out.append(f"| `{name}` | {dims} | {roles} | " + " | ".join(takes) + f" | {'yes' if name in INSPECTED else 'no'} |")
    extra = sorted(set(INSPECTED) - set(names))
    out += ["", f"`dpar.explain` also takes {', '.join(f'`{n}`' for n in extra)} (tp with sequence parallel) "
            "and `\"pipeline\"` (`dpar.pipeline`'s stages).", ""]
    return out


def _compile_options() -> list[str]:
    from dpar.compiler.options import Options

    source = (ROOT / "compiler" / "options.py").read_text()
    docs: dict[str, str] = {}
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Options")
    for field, following in zip(cls.body, cls.body[1:]):
        if isinstance(field, ast.AnnAssign) and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
            docs[field.target.id] = " ".join(str(following.value.value).split())
    out = ["## Compile options", "", '`torch.compile(model, backend="dpar", options={...})`; `Options` in '
           "`compiler/options.py`. An unknown key or a bad value raises `dpar.OptionsError` (a `ValueError`).", "",
           "| key | default | meaning |", "|---|---|---|"]
    for field in dataclasses.fields(Options):
        out.append(f"| `{field.name}` | `{field.default!r}` | {_cell(docs.get(field.name, ''))} |")
    return out + [""]


def _cli() -> list[str]:
    from dpar.cli import parser

    out = ["## The `dpar` command", "", "`dpar inspect` and `dpar plan` (`api/cli.py`). TARGET is `FILE.py[:fn]` "
           "or `package.module:fn`; `fn()` returns `(model, example_inputs)`; a file named without `:fn` is "
           "loaded through its `default()`.", ""]
    top = parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        out += [f"### `dpar {name}`", "", "| argument | default | choices | help |", "|---|---|---|---|"]
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flags = ", ".join(action.option_strings) or action.dest
            default = "" if action.default in (None, False) else f"`{action.default!r}`"
            if action.required and action.option_strings:
                default = "required"
            choices = ", ".join(map(str, action.choices)) if action.choices else ""
            out.append(f"| `{flags}` | {default} | {_cell(choices)} | {_cell(action.help or '')} |")
        out.append("")
    return out


def _errors() -> list[str]:
    from dpar.compiler.pipeline_parallel.schedules import PipelineBubbleWarning
    from dpar.core import errors
    from dpar.runtime.optimizer_graph import StepNotCapturedWarning

    out = ["## Errors and warnings", "", "Every class in `core/errors.py`, and the warnings. "
           "[troubleshooting.md](troubleshooting.md) gives each one's causes and fixes.", "",
           "| class | bases | raised when |", "|---|---|---|"]
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, BaseException) and c.__module__ == errors.__name__]
    for cls in sorted(classes, key=lambda c: c.__name__) + [PipelineBubbleWarning, StepNotCapturedWarning]:
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        public = f"dpar.{cls.__name__}" if hasattr(__import__("dpar"), cls.__name__) else f"{cls.__module__}.{cls.__name__}"
        out.append(f"| `{public}` | {bases} | {_cell(_first_line(cls))} |")
    return out + [""]


def environment_variables() -> set[str]:
    """Every environment variable named in the product code: read through ``os.environ``, or set (NCCL_DEFAULTS)."""
    found: set[str] = set()
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            found |= set(re.findall(r"os\.environ(?:\.get|\.pop|\.setdefault)?\(\s*[\"'](\w+)[\"']", text))
            found |= set(re.findall(r"os\.environ\[\s*[\"'](\w+)[\"']\s*\]", text))
            found |= set(re.findall(r"^ENV = [\"'](\w+)[\"']", text, re.M))
            found |= set(re.findall(r"[\"'](TORCH_NCCL_\w+)[\"']\s*:", text))
    return found


def _environment() -> list[str]:
    found = environment_variables()
    missing = sorted(found - set(ENVIRONMENT))
    if missing:
        raise SystemExit(f"docs/generate_reference.py: describe {missing} in ENVIRONMENT first")
    out = ["## Environment variables", "", "| variable | effect |", "|---|---|"]
    out += [f"| `{name}` | {ENVIRONMENT[name]} |" for name in sorted(found)]
    out += ["", "Read by the test suite only:", "", "| variable | effect |", "|---|---|"]
    out += [f"| `{name}` | {text} |" for name, text in TEST_ENVIRONMENT.items()]
    return out + [""]


def _presets() -> list[str]:
    from dpar.compiler.costs import PRESETS, DeviceSpec

    fields = [f.name for f in dataclasses.fields(DeviceSpec) if f.name not in ("name", "kernel_times", "mesh_links")]
    out = ["## Device presets", "", "`--device` of `dpar inspect` / `dpar plan`, `device=` of `dpar.explain` / "
           "`dpar.plan`: `dpar.compiler.costs.PRESETS`, or a `DeviceSpec` given by hand.", "",
           "| field | " + " | ".join(PRESETS) + " |", "|---|" + "---|" * len(PRESETS)]
    for field in fields:
        out.append(f"| `{field}` | " + " | ".join(f"{getattr(spec, field)!r}" for spec in PRESETS.values()) + " |")
    return out + [""]


def reference() -> str:
    sys.path.insert(0, str(ROOT))
    lines = ["# Reference", "", f"Generated from the code by `{COMMAND}`; `tests/test_docs.py` fails when it is stale. "
             "Do not edit by hand.", ""]
    for part in (_public_api, _strategies, _compile_options, _cli, _errors, _environment, _presets, _integrations):
        lines += part()
    return "\n".join(lines).rstrip() + "\n"


def notes() -> str:
    written: dict[str, list[str]] = defaultdict(list)
    cited: dict[str, set[str]] = defaultdict(set)
    for folder in NOTE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line in path.read_text().splitlines():
                head = line.strip().lstrip("#").strip().lstrip("r").lstrip('"').strip()
                for match in re.finditer(r"\[Note: ([^\]]+)\]", line):
                    title = match.group(1)
                    if head.startswith(f"[Note: {title}]"):
                        if rel not in written[title]:
                            written[title].append(rel)
                    else:
                        cited[title].add(rel)
    lines = ["# Index of `[Note: ...]` blocks", "",
             f"Generated from the code by `{COMMAND}`; `tests/test_docs.py` fails when it is stale. A Note is a "
             "comment or docstring that opens with `[Note: title]` and explains one hard part; code elsewhere "
             "cites it by title. Search the title to read it.", "",
             f"{len(written)} Notes.", "", "| Note | written in | cited from |", "|---|---|---|"]
    for title in sorted(written, key=str.lower):
        elsewhere = sorted(cited[title] - set(written[title]))
        lines.append(f"| {_cell(title)} | {', '.join(f'`{p}`' for p in written[title])} | "
                     f"{', '.join(f'`{p}`' for p in elsewhere)} |")
    orphans = sorted(set(cited) - set(written), key=str.lower)
    if orphans:
        lines += ["", "Cited, but written nowhere under that title:", ""]
        lines += [f"- {t} (cited from {', '.join(f'`{p}`' for p in sorted(cited[t]))})" for t in orphans]
    return "\n".join(lines) + "\n"


PAGES = {"docs/reference.md": reference, "docs/notes.md": notes}


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = []
    for rel, make in PAGES.items():
        text = make()
        path = ROOT / rel
        if path.exists() and path.read_text() == text:
            continue
        stale.append(rel)
        if not check:
            path.write_text(text)
    if stale:
        print(("stale: " if check else "wrote: ") + ", ".join(stale) + (f"; run {COMMAND}" if check else ""))
    return 1 if check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
