"""What a compiled XLA program launches, read from its optimised HLO text without running it.

For every kernel the program runs (a fusion, a library matmul, a Pallas/Triton or cuDNN call, a copy, a
collective) `census` reports the bytes it moves through device memory, the FLOPs of its dots, how many
times one call of the program runs it (loop trip counts multiplied through) and the source lines of
this project that produced it (from the module's stack-frame tables). `roofline_seconds` turns a kernel
into the least time a device could take for it. Together: where a step's memory traffic goes, and a
lower bound on its time, for a GPU that is not here (`gpu_compile.py`).

What the byte counts assume: a kernel reads each operand once and writes its output once, except that
an operand read only through slices (directly or after element-wise unary ops such as a convert)
counts as the slices, and a buffer updated in place by a dynamic-update-slice counts as the update
(as in a loop that fills one tile per iteration). Inside a `conditional` only the largest branch
counts (on CPU the step's only one is the optimizer update, whose other branch skips it). A loop whose
trip count XLA does not know counts once. A Pallas/Triton or cuDNN call's FLOPs are not in the HLO:
those of `KERNEL_FLOPS` (attention, the fused log-prob kernels) come from their shapes; the rest (the
GDN kernels, whose arithmetic is small beside their bytes) count by their bytes alone.
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import dataclass

from qwen35_bench.hlo import COLLECTIVES, DTYPE_BYTES

_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*?)\)(.*)$")
_FREE = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all", "partition-id",
         "replica-id"}
PROJECT_PATHS = ("/qwen35_jax/", "/qwen35_kernels/")
# ops that keep their operand's elements one for one: a slice after them reads only what it keeps
_UNARY = {"convert", "bitcast", "bitcast-convert", "reshape", "copy", "negate", "abs", "exponential", "log",
          "tanh", "sqrt", "rsqrt", "logistic", "sign", "floor", "ceil", "round-nearest-even", "not"}


@dataclass(frozen=True)
class Kernel:
    """One kernel of the program, totalled over its runs in one call of the program."""

    name: str
    category: str  # matmul | fusion | custom | copy | collective | other
    runs: int  # launches per call of the program
    bytes: int  # read + written, all runs
    flops: int  # dot FLOPs, all runs
    dot: str  # the dots' input precision: "bf16", "f32" (TF32 on a GPU), "f32-highest", "" without dots
    backward: bool  # made by a transposition (the backward pass)
    source: tuple[str, ...]  # "file.py:function:line" of this project's frames, innermost first


@dataclass(frozen=True)
class Instruction:
    name: str
    type: str  # its result type, e.g. "f32[8,128]{1,0}" or a tuple
    op: str
    arguments: str  # the text between the op's parentheses
    attributes: str

    @property
    def operands(self) -> tuple[str, ...]:
        return tuple(a.strip().lstrip("%") for a in self.arguments.split(",") if a.strip().startswith("%"))


def _product(dims: str) -> int:
    """Elements of an array with these comma-separated dimensions ("" for a scalar)."""
    return math.prod(int(d) for d in dims.split(",") if d)


def shape_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type (a tuple's elements added)."""
    return sum(_product(dims) * DTYPE_BYTES[dtype] for dtype, dims in _SHAPE.findall(type_text))


def _elements(type_text: str) -> int:
    return math.prod(_dims(type_text))


def _dims(type_text: str) -> list[int]:
    m = _SHAPE.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _attention_flops(products: int):
    """Causal attention whose first operand, q, is [B, S, H, D] (the Triton kernels' and cuDNN's; cuDNN's
    results are [B, H, S, D]): `products` matmuls of [S, D] x [D, S] size per head, the half above the
    diagonal skipped (a row of one document; packed documents let a kernel that skips across them do
    less)."""
    def flops(operand_types: list[str], result_type: str) -> int:
        b, s, h, d = _dims(operand_types[0])
        return products * 2 * b * h * s * s * d // 2
    return flops


def _logits_flops(products: int):
    """The fused log-prob kernels, whose first operands are hidden [T, D] and weight [D, V]: `products`
    matmuls of the logits' size (the logits; their recomputation, dh and dW in a backward)."""
    def flops(operand_types: list[str], result_type: str) -> int:
        (t, d), (_, v) = _dims(operand_types[0]), _dims(operand_types[1])
        return products * 2 * t * d * v
    return flops


# a custom kernel's name (a Pallas call's `name`, or the custom-call target) -> its FLOPs per run from
# its operand types and result type. Attention: the forward is two products (q k^T, p v), the backward
# five (q k^T again, dO v^T, p^T dO, dS k, dS^T q).
KERNEL_FLOPS = {
    "mha_forward": _attention_flops(2), "mha_backward": _attention_flops(5),
    "__cudnn$fmhaSoftmax": _attention_flops(2), "__cudnn$fmhaSoftmaxBackward": _attention_flops(5),
    "logprob_forward": _logits_flops(1), "logprob_backward": _logits_flops(3),
    "logprob_backward_dh": _logits_flops(2), "logprob_backward_dw": _logits_flops(2),
}


def kernel_name(instruction: Instruction) -> str:
    """A custom call's kernel: a Pallas/Triton call's `name`, else its target ("" for other ops)."""
    name = re.search(r'\bname = \\?"(\w+)', instruction.attributes)
    target = re.search(r'custom_call_target="([^"]*)"', instruction.attributes)
    return name.group(1) if name else target.group(1) if target else ""


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """({computation name: its instructions in order}, the entry computation's name)."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if line.startswith(("%", "ENTRY ")):
            name = re.match(r"(?:ENTRY )?%([\w.\-]+)", line).group(1)
            current = computations.setdefault(name, [])
            entry = name if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            m = _INSTRUCTION.match(re.sub(r"/\*index=\d+\*/", "", line))
            if m:
                current.append(Instruction(*m.groups()))
    if not entry:
        raise ValueError("no ENTRY computation in this HLO text")
    return computations, entry


def _table(text: str, title: str) -> dict[int, str]:
    m = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
    return dict((int(k), v) for k, v in (line.split(" ", 1) for line in m.group(1).splitlines())) if m else {}


class _Sources:
    """Stack-frame id -> this project's "file:function:line" frames, innermost first."""

    def __init__(self, text: str):
        self.files = {k: v.strip('"') for k, v in _table(text, "FileNames").items()}
        self.functions = {k: v.strip('"') for k, v in _table(text, "FunctionNames").items()}
        self.locations = {k: tuple(int(x) for x in re.findall(r"(?:file_name_id|function_name_id|line)=(\d+)", v)[:3])
                          for k, v in _table(text, "FileLocations").items()}
        # a frame's parent_frame_id is one more than its parent's id; 0 ends the chain
        self.frames = {k: tuple(int(x) for x in re.findall(r"=(\d+)", v))
                       for k, v in _table(text, "StackFrames").items()}

    def __call__(self, frame: int) -> tuple[str, ...]:
        out, seen = [], set()
        while frame in self.frames and frame not in seen:
            seen.add(frame)
            location, parent = self.frames[frame]
            file_id, function_id, line = self.locations[location]
            path = self.files[file_id]
            if any(p in path for p in PROJECT_PATHS):
                out.append(f"{path.rsplit('/', 1)[-1]}:{self.functions[function_id]}:{line}")
            frame = parent - 1
        return tuple(out)


class _Program:
    def __init__(self, text: str):
        self.computations, self.entry = parse_module(text)
        self.types = {c: {i.name: i.type for i in body} for c, body in self.computations.items()}
        self.sources = _Sources(text)
        self.kernels: list[Kernel] = []

    def dots(self, computation: str, instructions: list[Instruction] | None = None) -> tuple[int, str]:
        """(FLOPs, input precision) of the dots among `instructions` (default: the computation's) and
        in the fusions they call."""
        flops, kinds = 0, set()
        for i in self.computations.get(computation, []) if instructions is None else instructions:
            if i.op == "dot":
                lhs_type = self.types[computation].get(i.operands[0], "")
                lhs = _dims(lhs_type)
                contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.attributes)
                k = math.prod(lhs[int(d)] for d in (contracting.group(1).split(",") if contracting else []) if d)
                flops += 2 * _elements(i.type) * k
                shape = _SHAPE.search(lhs_type)
                dtype = shape.group(1) if shape else "f32"
                highest = "operand_precision={highest" in i.attributes
                kinds.add(f"{dtype}-highest" if highest and dtype == "f32" else dtype)
            called = re.search(r"calls=%([\w.\-]+)", i.attributes)
            if called and i.op == "fusion":
                f, inner = self.dots(called.group(1))
                flops += f
                kinds.update(filter(None, inner.split("+")))
        return flops, "+".join(sorted(kinds))

    def fused_traffic(self, computation: str, operand_bytes: list[int]) -> tuple[int, int]:
        """(bytes read, bytes written) of one run of a fusion (see the module docstring)."""
        body = self.computations[computation]
        params = {i.name: int(i.arguments) for i in body if i.op == "parameter"}
        users: dict[str, list[tuple[Instruction, int]]] = {i.name: [] for i in body}
        for i in body:
            for position, operand in enumerate(i.operands):
                if operand in users:
                    users[operand].append((i, position))

        def read_fraction(name: str, elements: int) -> float:
            """Of an array of `elements` elements, the fraction the fusion reads: through element-wise
            unary ops to the slices taken of it (an in-place update's buffer is not read)."""
            uses = users.get(name, [])
            if not uses:
                return 1.0
            total = 0.0
            for u, position in uses:
                if position == 0 and u.op in ("dynamic-slice", "slice", "gather"):
                    total += _elements(u.type) / max(elements, 1)
                elif position == 0 and u.op == "dynamic-update-slice":
                    continue
                elif u.op in _UNARY:
                    total += read_fraction(u.name, elements)
                else:
                    return 1.0
            return min(total, 1.0)

        read = 0
        for p, index in params.items():
            if index < len(operand_bytes):
                read += int(operand_bytes[index] * read_fraction(p, _elements(self.types[computation][p])))
        by_name = {i.name: i for i in body}

        def written(name: str) -> int:
            i = by_name[name]
            if i.op == "dynamic-update-slice":
                update = by_name.get(i.operands[1])
                return shape_bytes(update.type) if update else 0
            if i.op == "tuple":
                return sum(written(o) for o in i.operands)
            if i.op == "bitcast":
                return written(i.operands[0])
            return shape_bytes(i.type)

        return read, written(body[-1].name)

    def walk(self, computation: str, runs: int) -> None:
        types = self.types[computation]
        for i in self.computations[computation]:
            if i.op in _FREE or i.op.endswith("-done"):  # an async op counts once, at its start
                continue
            if i.op == "while":
                body = re.search(r"body=%([\w.\-]+)", i.attributes).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', i.attributes)
                self.walk(body, runs * (int(trips.group(1)) if trips else 1))
                continue
            if i.op in ("conditional", "call"):
                branches = re.findall(r"(?:true_computation|false_computation|to_apply)=%([\w.\-]+)", i.attributes)
                listed = re.search(r"branch_computations=\{([^}]*)\}", i.attributes)
                branches += re.findall(r"%([\w.\-]+)", listed.group(1)) if listed else []
                if branches:
                    self.walk(max(branches, key=lambda c: len(self.computations[c])), runs)
                continue
            operand_bytes = [shape_bytes(types.get(o, "")) for o in i.operands]
            read, written = sum(operand_bytes), shape_bytes(i.type)
            called = re.search(r"calls=%([\w.\-]+)", i.attributes)
            flops, dot = 0, ""
            if i.op == "fusion" and called:
                read, written = self.fused_traffic(called.group(1), operand_bytes)
                flops, dot = self.dots(called.group(1))
            elif i.op == "dot":
                flops, dot = self.dots(computation, [i])
            name = kernel_name(i) if i.op == "custom-call" else ""
            if name in KERNEL_FLOPS:
                flops = KERNEL_FLOPS[name]([types.get(o, "") for o in i.operands], i.type)
                shape = _SHAPE.search(types.get(i.operands[0], "") if i.operands else "")
                dot = shape.group(1) if shape else "f32"
            if i.op == "custom-call":
                category = "matmul" if "gemm" in name.lower() else "custom"
            elif flops:
                category = "matmul"
            elif i.op == "fusion":
                category = "fusion"
            elif i.op == "copy":
                category = "copy"
            elif i.op.startswith(COLLECTIVES):
                category = "collective"
            else:
                category = "other"
            op_name = re.search(r'op_name="([^"]*)"', i.attributes)
            frame = re.search(r"stack_frame_id=(\d+)", i.attributes)
            self.kernels.append(Kernel(
                name=i.name, category=category, runs=runs, bytes=(read + written) * runs, flops=flops * runs,
                dot=dot, backward=bool(op_name and "transpose(" in op_name.group(1)),
                source=self.sources(int(frame.group(1))) if frame else ()))


def census(hlo_text: str) -> list[Kernel]:
    """The kernels one call of the compiled program runs (`compiled.as_text()` after compilation)."""
    program = _Program(hlo_text)
    program.walk(program.entry, 1)
    return program.kernels


@dataclass(frozen=True)
class DevicePeaks:
    """Datasheet rates of one device: bytes/s of its memory, FLOP/s of its matmul units per input."""

    name: str
    memory_bandwidth: float
    bf16_flops: float
    tf32_flops: float  # float32 dots at default precision run as TF32 on Hopper
    f32_flops: float  # float32 at HIGHEST: CUDA cores (XLA's bf16x6/x9 emulation is no faster)


# NVIDIA's Hopper datasheets (SXM, dense, no sparsity)
DEVICE_PEAKS = {
    "h100": DevicePeaks("H100 SXM", 3.35e12, 989e12, 494.5e12, 67e12),
    "h200": DevicePeaks("H200 SXM", 4.8e12, 989e12, 494.5e12, 67e12),
}


def roofline_seconds(kernel: Kernel, peaks: DevicePeaks) -> float:
    """The least time `kernel` can take on that device: its bytes at full bandwidth or its FLOPs at the
    rate of its slowest dot input, whichever is longer. Launch gaps and imperfect overlap come on top."""
    rate = {"bf16": peaks.bf16_flops, "f16": peaks.bf16_flops, "f32": peaks.tf32_flops}
    flop_rate = min((rate.get(k, peaks.f32_flops) for k in kernel.dot.split("+") if k), default=peaks.bf16_flops)
    return max(kernel.bytes / peaks.memory_bandwidth, kernel.flops / flop_rate)


def by_category(kernels: list[Kernel], peaks: DevicePeaks) -> list[dict]:
    """One row per category: launches, GB, TFLOP, roofline ms; largest time first."""
    return _rows(kernels, peaks, lambda k: k.category)


def by_source(kernels: list[Kernel], peaks: DevicePeaks, *, categories: tuple[str, ...] = ("fusion", "copy")) -> list[dict]:
    """One row per innermost project source line (and direction) among `categories`: where the
    non-matmul memory traffic comes from; largest first."""
    def key(k: Kernel) -> str:
        where = k.source[0] if k.source else "(no project frame)"
        return f"{where} {'backward' if k.backward else 'forward'}"

    return _rows([k for k in kernels if k.category in categories], peaks, key)


# innermost-first search of a kernel's source frames (file basenames; the delta rule's files in
# qwen35_kernels/gated_delta_rule): the first frame naming one of these is its part
PARTS = (("step.py:update_if", "optimizer update"), ("logprob_entropy", "log-prob loss"),
         ("chunk_states", "GDN delta rule"), ("chunked.py", "GDN delta rule"), ("reference.py", "GDN delta rule"),
         ("triangular.py", "GDN delta rule"), ("matmul.py", "GDN delta rule"), ("gdn_inputs.py", "GDN conv, norms, gates"),
         ("gated_deltanet.py", "GDN projections, gated norm"), ("attention", "attention"), ("mlp.py", "MLP"),
         ("moe.py", "MoE"), ("norms.py", "RMS norms"), ("model.py", "embedding, residuals"))


def part_of(kernel: Kernel) -> str:
    """The model part a kernel belongs to (PARTS), from its innermost project frame that names one."""
    for frame in kernel.source:
        for marker, part in PARTS:
            if marker in frame:
                return part
    return "other"


def by_part(kernels: list[Kernel], peaks: DevicePeaks) -> list[dict]:
    """One row per model part (PARTS), every category; largest roofline time first."""
    return _rows(kernels, peaks, part_of)


def _rows(kernels: list[Kernel], peaks: DevicePeaks, key) -> list[dict]:
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0, 0.0])
    for k in kernels:
        t = totals[key(k)]
        t[0] += k.runs
        t[1] += k.bytes
        t[2] += k.flops
        t[3] += roofline_seconds(k, peaks)
    rows = [{"name": name, "launches": int(n), "gb": b / 1e9, "tflop": f / 1e12, "roofline_ms": s * 1e3}
            for name, (n, b, f, s) in totals.items()]
    return sorted(rows, key=lambda r: -r["roofline_ms"])
