"""A static check of lessons and tests: every tensor entering a collective, and every model entering a DDP/FSDP
wrapper, is created on (or moved to) the communication device, never left on the CPU where NCCL refuses it.

A small forward pass over the AST, statement by statement: a name is *on the CPU* when it was made by a torch
factory without `device=` (outside `with torch.device(...)`), by a model constructor without `.to(...)`, by
`.cpu()`, by `torch.stack`/`torch.cat` of such names, or returned in that position by a function of the same code
whose `return` builds it so. `.to(x)`, `.cuda()` and `device=x` (x not "cpu") move it. Only what is surely on the
CPU is reported, so names whose device the pass cannot tell (function arguments, library results) pass.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "logspace", "eye",
             "rand", "randn", "randint", "randperm", "empty_strided", "scalar_tensor"}
COMBINE = {"stack", "cat", "concat", "hstack", "vstack", "flatten", "_flatten_dense_tensors"}
# collectives whose every tensor argument must be on the communication device (object collectives pickle)
COLLECTIVES = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
               "gather", "scatter", "P2POp"}
WRAPPERS = {"SimpleDistributedDataParallelism", "NaiveDDP", "FlatDDP", "OverlapDDP", "BucketedDDP",
            "DistributedDataParallel", "DDP", "FSDP", "fully_shard"}
CPU, MOVED, GLOO_GROUP = "cpu", "moved", "gloo group"


def _is_cpu_literal(node: ast.AST | None) -> bool:
    if isinstance(node, ast.Constant):
        return node.value == "cpu"
    return (isinstance(node, ast.Call) and _name(node.func) in ("device", "torch.device") and bool(node.args)
            and _is_cpu_literal(node.args[0]))


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return ""


@dataclass
class Flow:
    """The state of the pass over one code unit (a lesson's cells in order, or one file)."""

    env: dict[str, str] = field(default_factory=dict)  # name -> CPU or MOVED
    returns: dict[str, list[bool]] = field(default_factory=dict)  # function -> which returned positions are CPU
    device_ctx: int = 0  # inside `with torch.device(not cpu)`
    hits: list[tuple[int, str]] = field(default_factory=list)

    # -- what an expression is -------------------------------------------------------------------------------
    def cpu(self, node: ast.AST | None) -> bool:
        """Whether `node` surely evaluates to a CPU tensor or model."""
        if isinstance(node, ast.Name):
            return self.env.get(node.id) == CPU
        if isinstance(node, (ast.Subscript, ast.Starred)):
            return self.cpu(node.value)
        if isinstance(node, (ast.List, ast.Tuple)):
            return any(self.cpu(e) for e in node.elts)
        if isinstance(node, ast.BinOp):
            return self.cpu(node.left) or self.cpu(node.right)
        if not isinstance(node, ast.Call):
            return False
        func, kw = node.func, {k.arg: k.value for k in node.keywords}
        if None in kw:  # **kwargs may carry a device
            return False
        if isinstance(func, ast.Attribute) and not _name(func.value).startswith("torch"):  # a method call
            if func.attr in ("to", "cuda", "type"):
                return func.attr == "to" and (_is_cpu_literal(node.args[0] if node.args else kw.get("device")))
            if func.attr == "cpu":
                return True
            return self.cpu(func.value)  # .clone(), .float(), .detach(), .view(...): where the receiver is
        name = _name(func)
        last = name.rsplit(".", 1)[-1]
        if name.startswith("torch.") and last in FACTORIES:
            return _is_cpu_literal(kw["device"]) if "device" in kw else not self.device_ctx
        if last in COMBINE:
            return any(self.cpu(a) for a in node.args)
        if last[:1].isupper() and last not in WRAPPERS and "device" not in kw:
            return not self.device_ctx and (name.startswith(("nn.", "torch.nn.")) or "." not in name)  # a model
        return False

    def call_returns(self, node: ast.AST) -> list[bool] | None:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return self.returns.get(node.func.id)
        return None

    # -- statements ----------------------------------------------------------------------------------------
    def gloo_group(self, node: ast.AST) -> bool:
        """A group made with backend="gloo": CPU tensors are its own (`dist.new_group(backend="gloo")`)."""
        if isinstance(node, ast.Name):
            return self.env.get(node.id) == GLOO_GROUP
        return (isinstance(node, ast.Call) and _name(node.func).endswith("new_group")
                and any(k.arg == "backend" and isinstance(k.value, ast.Constant) and k.value.value == "gloo"
                        for k in node.keywords))

    def bind(self, target: ast.AST, cpu: bool) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = CPU if cpu else MOVED

    def assign(self, targets: list[ast.AST], value: ast.AST) -> None:
        positions = self.call_returns(value)
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)) and positions is not None:
                for i, e in enumerate(t.elts):
                    self.bind(e, i < len(positions) and positions[i])
            elif isinstance(t, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
                for e, v in zip(t.elts, value.elts):
                    self.bind(e, self.cpu(v))
            elif isinstance(t, (ast.Tuple, ast.List)):
                for e in t.elts:  # unpacking a tensor: its rows are where it is
                    self.bind(e, self.cpu(value))
            elif isinstance(t, ast.Name) and self.gloo_group(value):
                self.env[t.id] = GLOO_GROUP
            else:
                self.bind(t, self.cpu(value))

    def check_call(self, node: ast.Call) -> None:
        name = _name(node.func)
        last = name.rsplit(".", 1)[-1]
        args = list(node.args) + [k.value for k in node.keywords if k.arg in ("tensor", "tensor_list", "output",
                                                                              "input", "output_tensor", "input_tensor")]
        group = next((k.value for k in node.keywords if k.arg == "group"), None)
        if group is not None and self.gloo_group(group):
            return  # a gloo group's collectives take CPU tensors
        if last in COLLECTIVES and (name.startswith(("dist.", "torch.distributed.")) or last == "P2POp"):
            for a in args:
                if self.cpu(a):
                    self.hits.append((node.lineno, f"{ast.unparse(a)} (a CPU tensor) enters {name}"))
        if last in WRAPPERS and node.args and self.cpu(node.args[0]):
            self.hits.append((node.lineno, f"{ast.unparse(node.args[0])} (a CPU model) enters {name}"))

    def function(self, fn: ast.FunctionDef) -> None:
        inner = Flow(dict(self.env), self.returns, self.device_ctx)
        for a in fn.args.args + fn.args.kwonlyargs:
            inner.env.pop(a.arg, None)  # arguments: device unknown
        inner.run(fn.body)
        self.hits += inner.hits
        for node in ast.walk(fn):
            if isinstance(node, ast.Return) and node.value is not None:
                elts = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                self.returns[fn.name] = [inner.cpu(e) for e in elts]

    def run(self, body: list[ast.stmt]) -> None:
        """Walk statements in order, updating names and recording hits."""
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.function(stmt)
                continue
            if isinstance(stmt, ast.ClassDef):
                continue
            compound = isinstance(stmt, (ast.With, ast.AsyncWith, ast.For, ast.While, ast.If, ast.Try))
            heads = [getattr(stmt, f) for f in ("test", "iter") if getattr(stmt, f, None) is not None] + \
                [i.context_expr for i in getattr(stmt, "items", [])] if compound else [stmt]
            for node in (n for head in heads for n in ast.walk(head)):  # a block's body is checked in order below
                if isinstance(node, ast.Call):
                    self.check_call(node)
            if isinstance(stmt, ast.Assign):
                self.assign(stmt.targets, stmt.value)
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                self.assign([stmt.target], stmt.value)
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                call = stmt.value  # model.to(device) / model.cuda() as a statement moves the module in place
                if isinstance(call.func, ast.Attribute) and call.func.attr in ("to", "cuda") and isinstance(call.func.value, ast.Name):
                    self.env[call.func.value.id] = CPU if self.cpu(call) else MOVED
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                on_device = any(_name(i.context_expr.func) in ("torch.device", "device") and not _is_cpu_literal(
                    i.context_expr.args[0] if i.context_expr.args else None)
                    for i in stmt.items if isinstance(i.context_expr, ast.Call))
                self.device_ctx += on_device
                self.run(stmt.body)
                self.device_ctx -= on_device
            elif isinstance(stmt, (ast.For, ast.While, ast.If, ast.Try)):
                for part in ("body", "orelse", "finalbody"):
                    self.run(getattr(stmt, part, []) or [])
                for handler in getattr(stmt, "handlers", []):
                    self.run(handler.body)


def cell_code(source: str) -> str:
    """A cell's Python, magics and shell lines removed (`%%rank [0]` cells run plain Python on the ranks)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def check_source(source: str, only: set[str] | None = None) -> list[tuple[int, str]]:
    """(line, what) for every CPU tensor or model that enters a collective or a wrapper in `source`; `only`: check
    just these module-level functions (a case module whose other functions run on gloo CPU ranks by design)."""
    body = ast.parse(source).body
    if only is not None:
        body = [s for s in body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) or s.name in only]
    flow = Flow()
    flow.run(body)
    return flow.hits


def check_notebook(nb) -> list[tuple[int, str]]:
    """(cell index, what) for a lesson: its code cells in order, sharing names as its ranks do."""
    flow, hits = Flow(), []
    for index, cell in enumerate(nb.cells):
        tags = cell.metadata.get("tags", [])
        if cell.cell_type != "code" or any(t.startswith("mirror:") for t in tags):
            continue  # mirrors are package files, checked by the package's own test
        try:
            tree = ast.parse(cell_code(cell.source))
        except SyntaxError:
            continue
        before = len(flow.hits)
        flow.run(tree.body)
        hits += [(index, what) for _, what in flow.hits[before:]]
    return hits
