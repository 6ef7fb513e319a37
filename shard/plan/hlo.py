"""The collectives in a compiled per-device program, read from its HLO text.

For each collective: its kind, the bytes of its result (every element of a tuple result), the size
n of its replica groups, and how many times it runs per call. A collective inside a `while` body
(a scanned layer stack) runs once per iteration: XLA records the trip count in the loop's
backend_config (`known_trip_count`), and the counts multiply through nested loops.

Bytes each device sends, by the ring model of each collective (n = group size, size = result bytes):
  all-reduce 2(n-1)/n x size; all-gather (n-1)/n x size; reduce-scatter (n-1) x size (the result
  is one of n pieces); all-to-all (n-1)/n x size; collective-permute: size, averaged over the devices
  (a permute whose pairs start at 2 of 8 devices sends size from each of those 2: size/4 a device). A ragged
  all-to-all sends only the rows its sizes name, known when it runs: counted as the all-to-all of its whole
  buffer, an upper bound (dropless routing's exchange: the padded exchange's bytes).
"""

import math
import re
from dataclasses import dataclass

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
               "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+(" + "|".join(KINDS) + r")(-start|-done)?\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_WHILE = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*s32\[\]\S*\s+constant\((\d+)\)")
_LESS = re.compile(r"^\s*ROOT\s.*\bcompare\(%?[\w.\-]+,\s*%?([\w.\-]+)\),\s*direction=LT")
_TRIP = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CALLED = re.compile(r"\b(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclass
class Collective:
    kind: str
    bytes: float      # result bytes per device
    group: int        # replica group size n
    count: int        # executions per call of the program
    senders: float = 1.0  # collective-permute: the share of devices that send (the others only receive)

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends for one execution, by the ring model."""
        n, size = self.group, self.bytes
        if n <= 1:
            return 0.0
        return {"all-reduce": 2 * (n - 1) / n * size, "all-gather": (n - 1) / n * size,
                "reduce-scatter": (n - 1) * size, "all-to-all": (n - 1) / n * size,
                "ragged-all-to-all": (n - 1) / n * size,
                "collective-permute": size * self.senders}[self.kind]


def shape_bytes(shape_text: str) -> float:
    """Bytes of an HLO result type: an array `f32[16,32]{1,0}` or a tuple of them."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def group_size(line: str, n_devices: int) -> int:
    """Size of the replica groups of a collective, in any of XLA's notations."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\S*?)?\s*\{([^}]*)\}", line)
    if mesh:  # mesh['axis_0'=2,'axis_1'=4] {'axis_1'} (device_ids=(...) between when the devices are reordered):
        # groups run along the named axes
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", mesh.group(2)))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if iota:  # [groups,size]<=[devices]
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([^}]*)\}", line)
    if listed:
        return len(listed.group(1).split(","))
    if "source_target_pairs" in line:
        return 2
    return n_devices  # replica_groups={}: every device


def _senders(line: str, n_devices: int) -> float:
    """A collective-permute's share of devices that send (1.0 for any other collective)."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if not pairs or not n_devices:
        return 1.0
    # A device paired with itself keeps its data (XLA writes such pairs when a permutation fixes some shards).
    sources = {a for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(0)) if a != b}
    return len(sources) / n_devices


def computations(text: str) -> tuple[dict[str, list[str]], str]:
    """(computation name -> its instructions, one a line, the entry computation's name). An instruction whose
    attributes span lines (a Pallas kernel's backend_config and frontend_attributes) is joined into one, so a
    line of it that starts with `}` does not end its computation."""
    out: dict[str, list[str]] = {}
    current = entry = None
    pending, depth, quoted = "", 0, False
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and not line.startswith(" "):
                current = header.group(2)
                out[current] = []
                if header.group(1):
                    entry = current
            continue
        if not pending and line.startswith("}"):  # the computation's own closing brace
            current = None
            continue
        pending = f"{pending} {line.strip()}" if pending else line
        depth, quoted = _balance(line, depth, quoted)
        if depth <= 0 and not quoted:
            out[current].append(pending)
            pending, depth = "", 0
    return out, entry


def _balance(line: str, depth: int, quoted: bool) -> tuple[int, bool]:
    """Brackets left open after `line`, and whether a quoted string is, counting none inside strings."""
    escaped = False
    for ch in line:
        if quoted:
            escaped, quoted = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            quoted = True
        elif ch in "{([":
            depth += 1
        elif ch in "})]":
            depth -= 1
    return depth, quoted


def trip_count(line: str, comps: dict[str, list[str]], unknown: int | None = 1) -> int | None:
    """A while loop's iterations: XLA's `known_trip_count` where the backend records it (CPU, GPU), else
    its condition's `counter < N` with N a constant (the TPU compiler's scans, counting from 0), else `unknown`
    (a data-dependent loop, e.g. dropless experts' exchange rounds: counted once)."""
    trip = _TRIP.search(line)
    if trip:
        return int(trip.group(1))
    cond = _CONDITION.search(line)
    lines = comps.get(cond.group(1), []) if cond else []
    constants = dict(m.groups() for m in map(_CONSTANT.match, lines) if m)
    bound = next((m.group(1) for m in map(_LESS.match, lines) if m), None)
    return int(constants[bound]) if bound in constants else unknown


def data_dependent_loops(text: str) -> int:
    """The program's while loops whose trip count depends on the data (each counted once in its figures)."""
    comps, _ = computations(text)
    return sum(1 for lines in comps.values() for line in lines
               if _WHILE.search(line) and trip_count(line, comps, unknown=None) is None)


def executions(comps: dict[str, list[str]], entry: str, loops: bool = True) -> dict[str, int]:
    """How many times each computation runs per call: loop bodies x their trip counts (`loops=False`:
    every body once, as XLA's cost analysis counts them)."""
    runs: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        if name not in comps or times == 0:
            return
        runs[name] = runs.get(name, 0) + times
        for line in comps[name]:
            body = _WHILE.search(line)
            if body:
                visit(body.group(1), times * (trip_count(line, comps) if loops else 1))
                continue
            for callee in _CALLED.findall(line):
                visit(callee, times)
            branches = _BRANCHES.search(line)
            if branches:
                for callee in re.findall(r"%?([\w.\-]+)", branches.group(1)):
                    visit(callee, times)

    visit(entry, 1)
    return runs


_ROUNDED = re.compile(r"%([\w.\-]+)\s*=\s*(bf16|f16)\[[\d,]*\]\S*\s+convert\(")


def _operands(text: str) -> list[str]:
    """The operand names of an instruction, from the text after its opening parenthesis."""
    return re.findall(r"%([\w.\-]+)", text.split(")", 1)[0])


def _rounded_to(comp: list[str]) -> str | None:
    """The narrower float a computation rounds its values to and widens back to float32 (a fusion holding
    convert(convert(x) to bf16) to f32), else None."""
    for line in comp:
        m = _ROUNDED.search(line)
        if m and any(re.search(rf"=\s*f32\[[\d,]*\]\S*\s+convert\(%{re.escape(m.group(1))}\)", other)
                     for other in comp):
            return m.group(2)
    return None


def _narrowed(operand: str, producers: dict, comps: dict) -> str | None:
    """The narrower float the value `operand` names was rounded to, else None: its fusion rounds it, or it is a
    scatter of values so rounded (a gather's gradient: the CPU backend widens the narrow scatter-add as well)."""
    line = producers.get(operand, "")
    call = _CALLED.search(line)
    comp = comps.get(call.group(1), []) if call else []
    narrow = _rounded_to(comp)
    if narrow is None and any(re.search(r"\sscatter\(", c) for c in comp) and "fusion(" in line:
        updates = _operands(line.split("fusion(", 1)[1])[-1:]  # scatter(operand, indices, updates)
        updates_call = _CALLED.search(producers.get(updates[0], "")) if updates else None
        narrow = _rounded_to(comps.get(updates_call.group(1), [])) if updates_call else None
    return narrow


def _result_bytes(shape: str, operands: list[str], producers: dict, comps: dict) -> float:
    """A collective's result bytes, each element in the dtype it was rounded to where XLA's CPU backend widened a
    narrower collective to float32 (its float normalization): what a GPU or TPU sends for the same program."""
    arrays = _ARRAY.findall(shape)
    if len(arrays) != len(operands):
        return shape_bytes(shape)
    total = 0.0
    for (dtype, dims), operand in zip(arrays, operands):
        narrow = _narrowed(operand, producers, comps) if dtype == "f32" else None
        total += DTYPE_BYTES.get(narrow or dtype, 0) * math.prod(int(d) for d in dims.split(",") if d)
    return total


def collectives(text: str, n_devices: int) -> list[Collective]:
    comps, entry = computations(text)
    runs = executions(comps, entry)
    producers = {m.group(1): line for lines in comps.values() for line in lines
                 if (m := re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line))}
    found, started = [], {}
    for name, lines in comps.items():
        if not runs.get(name):
            continue
        for line in lines:
            op = _OP.match(line)
            if not op:
                continue
            result_name, shape, kind, phase, operands = op.groups()
            if phase == "-start":  # async pair: the groups are on the start, the result on the done
                started[result_name] = (group_size(line, n_devices), _senders(line, n_devices))
                continue
            if phase == "-done":
                operand = re.match(r"\s*%?([\w.\-]+)", operands)
                group, senders = started.get(operand.group(1) if operand else None, (n_devices, 1.0))
            else:
                group, senders = group_size(line, n_devices), _senders(line, n_devices)
            size = (_result_bytes(shape, _operands(operands), producers, comps)
                    if kind in ("all-reduce", "reduce-scatter") else shape_bytes(shape))
            found.append(Collective(kind, size, group, runs[name], senders))
    return found


def summary(ops: list[Collective]) -> tuple[dict, float]:
    """({kind: {count, bytes}}, wire bytes per device), per call of the program."""
    table = {kind: {"count": 0, "bytes": 0.0} for kind in KINDS}
    wire = 0.0
    for op in ops:
        table[op.kind]["count"] += op.count
        table[op.kind]["bytes"] += op.count * op.bytes
        wire += op.count * op.wire_bytes
    return table, wire


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+?)\s+([\w\-]+)\((.*)$")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def dot_flops(text: str, loops: bool = True, convolutions: bool = False) -> float:
    """FLOPs of the matrix products the compiled program executes per call (2 per multiply-add), each
    `dot` counted as often as its computation runs (loop trip counts multiplied through): what the devices
    really compute, bubbles, recomputation and padding included. XLA's own cost analysis counts a loop
    body once (`loops=False` counts that way too). `convolutions`: count them too, by kernel features x
    window (an upper bound where the window runs over padding: the TPU compiler writes its matrix
    products as such convolutions)."""
    shapes, products = _products(text, loops, lambda op, rest: op == "dot" or convolutions and op == "convolution")
    total = 0.0
    for op, shape, rest, times in products:
        out = _ARRAY.search(shape)
        k = _contracted(rest, shapes) if op == "dot" else _convolved(rest, shapes)
        if out and k:
            total += 2.0 * math.prod(int(d) for d in out.group(2).split(",") if d) * k * times
    return total


def _products(text: str, loops: bool, wanted) -> tuple[dict, list]:
    """(every instruction's result type by name, [(op, result type, operands text, executions per call)] of the
    instructions `wanted(op, rest)` picks in computations that run)."""
    comps, entry = computations(text)
    runs = executions(comps, entry, loops)
    shapes, products = {}, []
    for name, lines in comps.items():
        for line in lines:
            ins = _INSTRUCTION.match(line)
            if not ins:
                continue
            result, shape, op, rest = ins.groups()
            shapes[result] = shape
            if runs.get(name) and wanted(op, rest):
                products.append((op, shape, rest, runs[name]))
    return shapes, products


def _operand_dims(rest: str, shapes: dict, which: int) -> list[int] | None:
    """The dimensions of an instruction's `which`-th operand (its type written inline, or its producer's)."""
    found = re.findall(r"(?:([a-z]+\d*\[[\d,]*\])\S*\s+)?%([\w.\-]+)", rest.split(")", 1)[0])
    if len(found) <= which:
        return None
    inline, name = found[which]
    dims = _ARRAY.search(inline or shapes.get(name, ""))
    return [int(d) for d in dims.group(2).split(",") if d] if dims else None


def _contracted(rest: str, shapes: dict) -> int | None:
    """A dot's multiply-adds per output element: the product of the left operand's contracting dimensions."""
    lhs, contracting = _operand_dims(rest, shapes, 0), _CONTRACTING.search(rest)
    if not lhs or not contracting:
        return None
    return math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i)


def _convolved(rest: str, shapes: dict) -> float | None:
    """A convolution's multiply-adds per output element, on average: the kernel's input features times the
    window positions that fall on the input, not on its padding (the TPU compiler writes matrix products as
    convolutions, and a collective matmul's pieces as windows over a padded input)."""
    lhs, rhs = _operand_dims(rest, shapes, 0), _operand_dims(rest, shapes, 1)
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
    if not lhs or not rhs or not labels or len(labels.group(2)) != len(rhs) or len(labels.group(1)) != len(lhs):
        return None
    lhs_labels, rhs_labels, _ = labels.groups()
    per_output = float(rhs[rhs_labels.index("i")])
    window = re.search(r"window=\{([^}]*)\}", rest)
    if not window:
        return per_output
    fields = dict(re.findall(r"(\w+)=(\S+)", window.group(1)))
    sizes = [int(w) for w in fields["size"].split("x")]
    def per_dim(key, default):
        return [tuple(int(p) for p in v.split("_")) if "_" in v else int(v)
                for v in fields[key].split("x")] if key in fields else [default] * len(sizes)
    pads, strides = per_dim("pad", (0, 0)), per_dim("stride", 1)
    lhs_dilations, rhs_dilations = per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
    for d, size in enumerate(sizes):
        extent = (lhs[lhs_labels.index(str(d))] - 1) * lhs_dilations[d] + 1  # the input, dilated
        (low, high), stride, dilate, rhs_dilate = pads[d], strides[d], lhs_dilations[d], rhs_dilations[d]
        outputs = (extent + low + high - (size - 1) * rhs_dilate - 1) // stride + 1
        if outputs <= 0:
            return 0.0
        per_output *= _hits(outputs, size, stride, rhs_dilate, low, extent, dilate) / outputs
    return per_output


def _hits(outputs: int, size: int, stride: int, rhs_dilate: int, low: int, extent: int, dilate: int) -> int:
    """Window positions that fall on input elements (not padding, not a dilation's holes), over all outputs."""
    hits = 0
    for w in range(size):
        start = w * rhs_dilate - low  # output o reads input o * stride + start
        if dilate == 1:  # the outputs whose read lands in [0, extent)
            first, last = (max(0, -(start // stride) if start < 0 else 0),
                           min(outputs - 1, (extent - 1 - start) // stride))
            hits += max(0, last - first + 1)
        else:
            hits += sum(1 for o in range(outputs) if 0 <= (at := o * stride + start) < extent and at % dilate == 0)
    return hits


_CYCLES = re.compile(r'"estimated_cycles"\s*:\s*"(\d+)"')
# Custom calls that are whole kernels the compiler's cost model cannot see into: Pallas/Mosaic on TPU, cuDNN's
# fused attention and Pallas's Triton and Mosaic GPU kernels on GPU.
_KERNEL = re.compile(r'custom_call_target="(tpu_custom_call|__cudnn\$fmha[^"]*|__gpu\$xla\.gpu\.triton|mosaic_gpu\w*)"')


def loop_scale(text: str) -> tuple[float, str]:
    """How much more work the program does with every loop run its trip count than with each loop body
    counted once (as XLA's cost analysis counts them), and what that was weighed by: the TPU compiler's own
    per-instruction estimates (`estimated_cycles`) where the program has them, else matrix-product FLOPs. A
    body's share of the step is scaled by its trips, and only it: the work outside loops counts once."""
    comps, entry = computations(text)
    weights = {name: sum(int(c) for line in lines for c in _CYCLES.findall(line)) for name, lines in comps.items()}
    basis = "the compiler's per-instruction cycle estimates"
    if not any(weights.values()):
        once, looped = dot_flops(text, loops=False, convolutions=True), dot_flops(text, convolutions=True)
        return (looped / once if once else 1.0), "matrix-product FLOPs"
    runs, once = executions(comps, entry), executions(comps, entry, loops=False)
    counted = sum(w * once.get(name, 0) for name, w in weights.items())
    return (sum(w * runs.get(name, 0) for name, w in weights.items()) / counted if counted else 1.0), basis


@dataclass(frozen=True)
class Kernels:
    """The custom-call kernels a program runs (Pallas/Mosaic, cuDNN's), executions per call with loops' trips
    multiplied through. A kernel that states its own cost (a Pallas `cost_estimate`: tokamax's, megablox's and XLA's
    own grouped-product kernels on TPU) is counted by the TPU cost model, but once per loop body like everything
    else; one that states none (splash attention, cuDNN's, Triton's) counts zero there."""
    calls: int = 0  # every kernel's runs
    grouped: int = 0  # of those, the grouped products' (and the helper that computes their groups' offsets)
    estimated_flops: float = 0.0  # the FLOPs the kernels' own estimates state, over every run
    estimated_once: float = 0.0  # the same with each loop body once: what the cost analysis already holds
    attention_runs: int = 0  # runs of attention's kernels (every kernel not a grouped product's)
    grouped_runs: int = 0  # runs of grouped products' kernels (the offsets' helper not counted)
    attention_unestimated: int = 0  # of attention_runs, those whose kernel states no cost
    grouped_unestimated: int = 0  # of grouped_runs, those whose kernel states no cost


def kernels(text: str) -> Kernels:
    """The custom-call kernels the program runs, by kind, with the FLOPs their own cost estimates state."""
    comps, entry = computations(text)
    runs, once = executions(comps, entry), executions(comps, entry, loops=False)
    n = dict(calls=0, grouped=0, estimated_flops=0.0, estimated_once=0.0, attention_runs=0, grouped_runs=0,
             attention_unestimated=0, grouped_unestimated=0)
    for name, lines in comps.items():
        for line in lines:
            if not _KERNEL.search(line) or not runs.get(name):
                continue
            times, estimate = runs[name], _ESTIMATE.search(line)
            n["calls"] += times
            n["estimated_flops"] += int(estimate.group(1)) * times if estimate else 0
            n["estimated_once"] += int(estimate.group(1)) * once.get(name, 0) if estimate else 0
            grouped = bool(_GROUPED.search(line))
            n["grouped"] += times if grouped else 0
            if grouped and _GROUPS_HELPER.search(line):  # offsets, not products
                continue
            kind = "grouped" if grouped else "attention"
            n[f"{kind}_runs"] += times
            n[f"{kind}_unestimated"] += 0 if estimate else times
    return Kernels(**n)


def kernel_calls(text: str, kind: str | None = None) -> int:
    """Executions per call of the custom-call kernels (Pallas, cuDNN attention) the program runs; kind: only the
    "grouped" products' (_GROUPED) or "attention"'s (the others)."""
    k = kernels(text)
    return {None: k.calls, "grouped": k.grouped, "attention": k.calls - k.grouped}[kind]


# A grouped product's kernel, by its instruction's name or the call it was traced in: XLA's own TPU lowering of
# ragged_dot (ragged-dot-none, and ragged-dot-metadata computing the groups' offsets), tokamax's megablox kernels
# (gmm_megablox the forward, gmm_megablox_transpose_rhs the rows' gradient, tgmm_megablox the matrices'), JAX's and
# MaxText's megablox (gmm and tgmm, called as jit(gmm), jit(tgmm)), and any kernel called inside a ragged_dot (tokamax's
# GPU kernels: their op_name).
_GROUPED = re.compile(r'^\s*(?:ROOT\s+)?%(?:t?gmm|ragged[-_]dot)[\w.\-]*\s*='
                      r'|op_name="[^"]*(?:ragged[-_.]dot|jit\(t?gmm\))')
_GROUPS_HELPER = re.compile(r'^\s*(?:ROOT\s+)?%ragged[-_]dot[-_]metadata|op_name="ragged[-_]dot[-_]metadata"')
_ESTIMATE = re.compile(r'"cost_estimate"\s*:\s*\{\s*"flops"\s*:\s*"(\d+)"')


_GEMM = re.compile(r'custom_call_target="__cublas\$(?:lt\$)?(?:gemm|matmul)[^"]*"')


def dot_types(text: str) -> dict[str, int]:
    """Matrix products the program executes per call by their operands' element types ("s8", "f8e4m3fn x
    f8e5m2", "bf16"), loop trip counts multiplied through: dots, convolutions (the TPU compiler's products) and
    cuBLAS's GEMM calls. Shows whether quantized products (train.quantize) survive compilation as such."""
    shapes, products = _products(text, True, lambda op, rest: op in ("dot", "convolution")
                                 or op == "custom-call" and bool(_GEMM.search(rest)))
    counts: dict[str, int] = {}
    for _, _, rest, times in products:
        found = re.findall(r"(?:([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[[\d,]*\]\S*\s+)?%([\w.\-]+)", rest.split(")", 1)[0])
        types = [inline or (_ARRAY.search(shapes.get(operand, "")) or [None, "?"])[1] for inline, operand in found[:2]]
        key = " x ".join(dict.fromkeys(types)) or "?"
        counts[key] = counts.get(key, 0) + times
    return counts
