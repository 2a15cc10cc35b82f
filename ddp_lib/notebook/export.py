"""`%dist_export train.py` / `python -m ddp_lib.notebook.export NOTEBOOK -o train.py`: the rank cells, as a script.

Which cell ran where follows the magics' own rule (`DistributedMagics._auto_transformer`, nbdistributed's): after
`%dist_init`, a cell runs on every rank unless it starts with `%` (a magic: it runs in the kernel) or holds only
comments; `%%distributed` runs on every rank, `%%rank [..]` on the listed ranks; `%dist_mode -d` sends plain cells back
to the kernel (`-e` to the ranks), `%dist_shutdown` and `%dist_reset` end the ranks. A saved notebook's cells are taken
in execution_count order (the order they ran), leaving out cells that never ran; the kernel's own history is that
order already. The notebook is only read.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import io
import re
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

from ddp_lib.notebook import _export_prologue
from ddp_lib.notebook._launch_files import write_launch_files

RANK_NAMES = {"rank", "world_size", "device", "gpu_id", "dist", "torch", "get", "display"}  # what %dist_init defines
_RANKS = re.compile(r"^\s*%%rank\s*\[([^\]]*)\]")
_FUTURE = re.compile(r"^from __future__ import [\w, ()]+\n?", re.M)
SKIP = "# dist_export: skip"  # a rank cell with a line ending so is left out: one about the script, not the training


class ExportError(ValueError):
    """The cells cannot become a script that does what the ranks did; the message says which cell and why."""


@dataclass
class Cell:
    """One executed code cell: its source and the number the notebook shows beside it (`[3]`)."""

    source: str
    label: int | None


def rank_list(spec: str) -> list[int]:
    """The ranks `%%rank [spec]` names, as written ("0,2", "0-2"); ValueError for anything else."""
    ranks: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        a, _, b = part.partition("-")
        ranks.extend(range(int(a), int(b) + 1) if b else [int(a)])
    return ranks


def _parse_ranks(spec: str, label) -> tuple[int, ...]:
    try:
        return tuple(sorted(set(rank_list(spec))))
    except ValueError:
        raise ExportError(f"cell [{label}]: %%rank [{spec}] is not a rank list such as [0,2] or [0-2]") from None


def _kernel_python(source: str) -> str:
    """A kernel cell as IPython runs it (magics and `!` lines become calls), for the names it binds."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def _bound(tree: ast.AST) -> set[str]:
    """Every name a piece of code binds anywhere (assignments, imports, defs, loop and with targets, parameters)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.add(node.name)
    return out


def _read(tree: ast.AST) -> list[str]:
    seen: dict[str, None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            seen.setdefault(node.id)
    return list(seen)


def _indent(code: str, prefix: str = "    ") -> str:
    """Indent `code` for an `if` block, leaving the inside of multi-line strings as it was (their value)."""
    lines = code.splitlines(keepends=True)
    inside: set[int] = set()  # 0-based lines that continue a string token begun on an earlier line
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type in (tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)) and tok.end[0] > tok.start[0]:
            inside.update(range(tok.start[0], tok.end[0]))
    return "".join(ln if i in inside or not ln.strip() else prefix + ln for i, ln in enumerate(lines))


def classify(cells: list[Cell]) -> list[tuple[Cell, tuple[int, ...] | None | str]]:
    """Each cell with where it ran: "all", a tuple of ranks, None (the kernel), or "magic" (a kernel magic cell)."""
    out: list = []
    ranks_up = auto = False
    for cell in cells:
        src = cell.source
        stripped = src.strip()
        first = stripped.splitlines()[0].strip() if stripped else ""
        if not stripped or all(not ln.strip() or ln.strip().startswith("#") for ln in src.splitlines()):
            continue
        if m := _RANKS.match(src):
            if not ranks_up:
                raise ExportError(f"cell [{cell.label}] is a %%rank cell before any %dist_init: no ranks ran it")
            out.append((Cell(src.split("\n", 1)[1] if "\n" in src else "", cell.label), _parse_ranks(m[1], cell.label)))
        elif first.startswith("%%distributed"):
            if not ranks_up:
                raise ExportError(f"cell [{cell.label}] is a %%distributed cell before any %dist_init: no ranks ran it")
            out.append((Cell(src.split("\n", 1)[1] if "\n" in src else "", cell.label), "all"))
        elif stripped.startswith("%"):
            for ln in stripped.splitlines():
                words = ln.split()
                if words and words[0] == "%dist_init":
                    ranks_up = auto = True
                elif words and words[0] in ("%dist_shutdown", "%dist_reset"):
                    ranks_up = auto = False
                elif words and words[0] == "%dist_mode" and ranks_up:
                    auto = True if {"-e", "--enable"} & set(words) else False if {"-d", "--disable"} & set(words) else auto
            out.append((cell, "magic"))
        else:
            out.append((cell, "all" if auto else None))
    return out


def export_script(cells: list[Cell], source: str = "the notebook", cpu_only: bool = False) -> str:
    """The script: prologue, every rank cell in order (`%%rank` ones as `if rank in (...)`), epilogue."""
    body: list[str] = []
    kernel_names: dict[str, tuple[int | None, str]] = {}  # name -> the left-out cell that bound it, and why
    rank_names = set(RANK_NAMES) | set(dir(builtins))
    future, left_out = False, 0
    for cell, where in classify(cells):
        skip = where not in (None, "magic") and any(ln.rstrip().endswith(SKIP) for ln in cell.source.splitlines())
        if where in (None, "magic") or skip:
            what = ("magics, run by the kernel" if where == "magic" else f"marked {SKIP!r}" if skip else
                    "ran in the kernel, not on the ranks")
            first = cell.source.strip().splitlines()[0][:60]
            body.append(f"# [{cell.label}] left out ({what}): {first}\n")
            left_out += 1
            try:
                kernel_names.update((n, (cell.label, what)) for n in _bound(ast.parse(_kernel_python(cell.source))))
            except SyntaxError:
                pass  # a kernel cell that did not parse failed there and bound nothing
            continue
        code = cell.source
        if _FUTURE.search(code):
            future, code = True, _FUTURE.sub("", code)
        try:
            tree = ast.parse(code, f"<cell [{cell.label}]>")
        except SyntaxError as e:
            raise ExportError(f"cell [{cell.label}] ran on the ranks but is not plain Python ({e.msg}, line {e.lineno}):"
                              " magics and `!` lines run in the kernel only") from None
        for name in _read(tree):
            if name in kernel_names and name not in rank_names and name not in _bound(tree):
                label, what = kernel_names[name]
                raise ExportError(
                    f"cell [{cell.label}] reads {name!r}, which only the kernel had (bound in cell [{label}], which "
                    f"{what if what.startswith('ran') else 'is left out: ' + what}): define {name!r} in a cell that "
                    "runs on every rank, or export would write a script that fails with a NameError")
        rank_names |= _bound(tree)
        if where == "all":
            body.append(f"# [{cell.label}] on every rank\n{code.rstrip()}\n")
        else:
            body.append(f"# [{cell.label}] %%rank {list(where)}\nif rank in {where!r}:\n{_indent(code.rstrip())}\n")
    if len(body) == left_out:
        raise ExportError(f"no cell of {source} ran on the ranks: the script would only join the process group and "
                          "leave it. Run the training cells after %dist_init (a restarted kernel has run none), then "
                          "export")
    prologue = inspect_prologue()
    head = textwrap.dedent(f'''\
        """Exported by ddp_lib.notebook.export from {source}: the cells that ran on the ranks, in the order they ran.

        Run with torchrun (torchrun --nproc-per-node 2 {{this file}}) or srun; the prologue does what %dist_init did.
        """
        ''')
    setup = ("# multiprocessing's spawn and forkserver children re-run the main script (as __mp_main__) to find its\n"
             "# functions, prologue and training included; a notebook rank has no script file, so neither has this one\n"
             "globals().pop('__file__', None)\n"
             f"CPU_ONLY = {cpu_only!r}  # EDIT: True keeps every rank on the CPU (gloo), as %dist_init --cpu did\n"
             "rank, world_size, device = init_from_launcher(CPU_ONLY)\n"
             "gpu_id = device.index if device.type == 'cuda' else None\n"
             "try:\n    from ddp_lib.mesh import get\nexcept ImportError:  # the course's package is not installed\n"
             "    pass\n\n\ndef display(*objs, **kwargs):\n    \"\"\"A notebook's display(): here, the text.\"\"\"\n"
             "    print(*objs)\n\n\n")
    tail = "\n# what %dist_shutdown did: leave the process group\ndist.destroy_process_group()\n"
    return (head + ("from __future__ import annotations\n\n" if future else "") + prologue + "\n\n" + setup
            + "\n".join(body) + tail)


def inspect_prologue() -> str:
    """The prologue's source, between its markers."""
    text = Path(_export_prologue.__file__).read_text()
    return text.split("# --- prologue: begin ---\n", 1)[1].split("# --- prologue: end ---", 1)[0].rstrip() + "\n"


def notebook_cells(path: str | Path, order: str = "execution") -> list[Cell]:
    """A saved notebook's code cells in the order they ran (execution_count), or in document order."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    cells = [Cell(c.source, c.get("execution_count")) for c in nb.cells if c.cell_type == "code"]
    if order == "document":
        return cells
    ran = [c for c in cells if c.label is not None]
    if not ran:
        raise ExportError(f"{path}: no cell has run (no execution_count): run the notebook, or export with "
                          "--order document to take the cells as they stand")
    counts = [c.label for c in ran]
    if len(set(counts)) != len(counts):
        dup = sorted({n for n in counts if counts.count(n) > 1})
        raise ExportError(f"{path}: execution counts {dup} appear twice (the kernel restarted between cells?): the "
                          "order the cells ran in is lost; restart and run all, then export")
    return sorted(ran, key=lambda c: c.label)


def cpu_only_of(cells: list[Cell]) -> bool:
    """Whether the last %dist_init of these cells asked for CPU ranks (`--cpu`)."""
    inits = [ln for c in cells for ln in c.source.splitlines() if ln.strip().startswith("%dist_init")]
    return bool(inits) and "--cpu" in inits[-1].split()


def write(cells: list[Cell], out: str | Path, source: str, launch_files: bool = True) -> list[Path]:
    """Write the script (and its launch files beside it); returns the paths written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(export_script(cells, source, cpu_only_of(cells)))
    return [out] + (write_launch_files(out) if launch_files else [])


def main(argv: list[str] | None = None) -> int:
    """`python -m ddp_lib.notebook.export NOTEBOOK -o train.py`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebook")
    p.add_argument("-o", "--output", default="train.py")
    p.add_argument("--order", choices=("execution", "document"), default="execution",
                   help="execution: the cells that ran, in execution_count order; document: every cell, top to bottom")
    p.add_argument("--no-launch-files", action="store_true", help="write the script only")
    a = p.parse_args(argv)
    try:
        paths = write(notebook_cells(a.notebook, a.order), a.output, a.notebook, not a.no_launch_files)
    except ExportError as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
