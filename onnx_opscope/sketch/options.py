"""Options of the sketches (saved in every manifest) and what a sketch knows about the tensor it reads."""

from __future__ import annotations

from dataclasses import dataclass, replace

from onnx import TensorProto

from ..graph.opset import has_op

HIST_MODES = ("sampled", "exact", "host")


@dataclass(frozen=True)
class SketchOptions:
    """Knobs of the sketches; saved in the manifest so decoding uses the same ones."""

    hist_bins: int = 32
    hist_range: tuple[float, float] | None = None  # None: x/(max|x|+1e-12) over [-1, 1]
    hist_mode: str = "sampled"  # sampled | exact (every element) | host (copy out, bin in numpy)
    # exact: counted in the graph (ScatterElements / Unique), or bin indices computed in the graph
    # and counted on the host (np.bincount) -- what `for_providers` picks on CPU, where the
    # outputs are not copied and the in-graph scatter costs ~35 passes over the tensor.
    exact_counts: str = "graph"
    sample_size: int = 4096
    elemsig_k: int = 16
    # pos_sumsq / adj_sumsq keep at most this many rows, evenly strided: a prime, so that the stride does not
    # alias with a power-of-two row period (512 rows of a [2, 16, 32, 32] Conv input saw only columns 0, 4, 8, ...)
    max_rows: int = 509
    adj_pairs: int = 32  # adj_sumsq: adjacent pairs per sequence, evenly spaced along the row axis
    # Taps on tensors of at most this many elements (at the shapes `inject` is told to expect) are
    # copied out whole and sketched on the host, all of a batch's together (`sketch.batched`): in
    # the graph a tap's ~35 nodes cost ~40 µs however small the tensor. None: `for_providers`
    # decides (sample_size on the CPU provider, whose outputs are not copied; 0 elsewhere, where it
    # is not measured yet); 0: never. At most sample_size, where the sample is the whole tensor.
    copy_out_max: int | None = None

    def __post_init__(self):
        if self.hist_mode not in HIST_MODES:
            raise ValueError(f"hist_mode must be one of {HIST_MODES}, not {self.hist_mode!r}")
        if self.exact_counts not in ("graph", "host"):
            raise ValueError(f"exact_counts must be 'graph' or 'host', not {self.exact_counts!r}")
        if self.hist_range is not None and not self.hist_range[0] < self.hist_range[1]:
            raise ValueError(f"hist_range needs lo < hi, got {self.hist_range}")
        if self.copy_out_max is not None and not 0 <= self.copy_out_max <= self.sample_size:
            raise ValueError(
                f"copy_out_max must be in [0, sample_size={self.sample_size}], not {self.copy_out_max}"
            )

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if d["hist_range"] is not None:
            d["hist_range"] = list(d["hist_range"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SketchOptions:
        d = dict(d)
        if d.get("hist_range") is not None:
            d["hist_range"] = tuple(d["hist_range"])
        return cls(**d)


def for_providers(o: SketchOptions, providers: list[str]) -> SketchOptions:
    """`o` as it should run on `providers`: exact histograms are counted on the host when the
    CPU provider runs everything (bert_like: 14.8x plain in the graph, see BENCHMARKS.md), and
    small tensors copied out whole there (`copy_out_max`)."""
    cpu_only = all(p == "CPUExecutionProvider" for p in providers)
    if o.hist_mode == "exact" and cpu_only and o.exact_counts == "graph":
        o = replace(o, exact_counts="host")
    if o.copy_out_max is None:
        o = replace(o, copy_out_max=o.sample_size if cpu_only else 0)
    return o


def for_opset(o: SketchOptions, opset: int) -> SketchOptions:
    """`o` as the taps can be built at `opset`: exact histograms are counted on the host (from the
    graph's bin indices, the same counts) where neither ScatterElements nor Unique exists (< 11)."""
    if o.hist_mode == "exact" and o.exact_counts == "graph" and not has_op("Unique", opset):
        return replace(o, exact_counts="host")
    return o


@dataclass(frozen=True)
class TapInfo:
    """What a sketch needs to know about a tapped tensor.

    `channel_axis` is the feature axis (chan_maxabs keeps it; pos_sumsq sums over it);
    `seq_axis` is the axis along which rows are adjacent (adj_sumsq). `rank` None means
    unknown: then only the rank-free sketches are built.
    """

    rank: int | None
    elem_type: int = TensorProto.FLOAT
    channel_axis: int = -1
    seq_axis: int = -2
    bins: int | None = None  # route_load: the experts (None: max id + 1, in the graph); head_*: kv heads

    @property
    def as_rows(self) -> bool:
        """Rank unknown but channel-last with rows along -2 (every MatMul operand): the tensor is then
        viewed as [rows, channels] = reshape(x, [-1, C]), rows running over all leading axes."""
        return self.rank is None and self.channel_axis == -1 and self.seq_axis == -2

    def axes(self) -> tuple[int, int | None] | None:
        """(channel, seq) as non-negative axes, seq None when rank < 2; None when rank unknown/0."""
        if self.as_rows:
            return 1, 0
        if not self.rank:
            return None
        ch = self.channel_axis % self.rank
        seq = self.seq_axis % self.rank if self.rank >= 2 else None
        return ch, (seq if seq != ch else None)
