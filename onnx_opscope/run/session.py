"""onnxruntime sessions: execution-provider choice, session options, and one-line failures.

Providers are asked for by short name (`cuda`, `coreml`, ...) or full name, in priority
order. onnxruntime itself only warns and runs on CPU when a provider is missing; we refuse
instead (or, with `fallback`, drop it with a warning), so a recording never claims a
provider it did not use. The session options (optimization level, threads) are recorded
with the results, because tapping tensors changes which fusions onnxruntime applies.
In-memory models keep their external weights on disk: onnxruntime is told the folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import ModelProto, TensorProto, helper, numpy_helper

from ..errors import OpscopeError, did_you_mean, listing
from ..graph.io import ModelLike, check_external_data, external_files, load_model, save_model
from .feeds import InputSpec, check_feeds, describe_feeds

CPU = "CPUExecutionProvider"
_SUFFIX = "ExecutionProvider"
# Short names beyond `full name minus "ExecutionProvider", lowercased`, and providers this
# onnxruntime build may not list at all (get_all_providers() differs between versions).
_ALIASES = {
    "trt": "TensorrtExecutionProvider",
    "directml": "DmlExecutionProvider",
    "onednn": "DnnlExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "acl": "ACLExecutionProvider",
    "armnn": "ArmNNExecutionProvider",
    "tvm": "TvmExecutionProvider",
    "nv_tensorrt_rtx": "NvTensorRTRTXExecutionProvider",
}
_HOW_TO_GET = {
    "CUDAExecutionProvider": "install onnxruntime-gpu (and CUDA/cuDNN) instead of onnxruntime",
    "TensorrtExecutionProvider": "install onnxruntime-gpu with TensorRT instead of onnxruntime",
    "CoreMLExecutionProvider": "CoreML comes with the onnxruntime wheel for macOS only",
    "DmlExecutionProvider": "install onnxruntime-directml (Windows) instead of onnxruntime",
    "OpenVINOExecutionProvider": "install onnxruntime-openvino instead of onnxruntime",
    "QNNExecutionProvider": "install onnxruntime-qnn (Qualcomm NPUs) instead of onnxruntime",
    "MIGraphXExecutionProvider": "install onnxruntime-migraphx (AMD GPUs) instead of onnxruntime",
    "ROCMExecutionProvider": "use an onnxruntime build with ROCm (newer releases use MIGraphX)",
    "CANNExecutionProvider": "install onnxruntime-cann (Huawei Ascend) instead of onnxruntime",
}
# onnxruntime >= 1.18 resolves an in-memory model's external data against this folder.
_EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"
_MOVED_LOCATION = "opscope-weights-in-session"  # placeholder of initializers moved by _move_weights
_PROTO_LIMIT = 2**31 - 1

try:
    from onnxruntime.capi import onnxruntime_pybind11_state as _state

    _ORT_ERRORS: tuple[type[BaseException], ...] = (
        RuntimeError,
        ValueError,
        *(v for v in vars(_state).values() if isinstance(v, type) and issubclass(v, Exception)),
    )
except ImportError:  # pragma: no cover - layout of onnxruntime's private module changed
    _ORT_ERRORS = (Exception,)

GRAPH_OPT_LEVELS = {
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}
EXECUTION_ORDERS = {"default": ort.ExecutionOrder.DEFAULT, "priority": ort.ExecutionOrder.PRIORITY_BASED}


class ProviderFallbackWarning(UserWarning):
    """A requested execution provider was dropped because `fallback` was asked for."""


def known_providers() -> dict[str, str]:
    """Short name -> full name for every provider onnxruntime knows of, built or not."""
    names = {p[: -len(_SUFFIX)].lower(): p for p in ort.get_all_providers() if p.endswith(_SUFFIX)}
    return {**names, **{k: v for k, v in _ALIASES.items() if k not in names}}


def _full_name(name: str, known: dict[str, str]) -> str:
    key = name.strip().lower()
    if key in known:
        return known[key]
    by_full = {v.lower(): v for v in known.values()}
    if key in by_full:
        return by_full[key]
    if key.endswith(_SUFFIX.lower()) and key[: -len(_SUFFIX)] in known:
        return known[key[: -len(_SUFFIX)]]
    raise OpscopeError(
        f"unknown execution provider {name.strip()!r}{did_you_mean(key, known)}; "
        f"known: {listing(known, limit=40)}",
        hint="short names like cpu, cuda, coreml, dml, openvino, tensorrt, or full names like "
        "CUDAExecutionProvider",
    )


def resolve_providers(providers: str | Sequence[str] = "cpu", fallback: bool = False) -> list[str]:
    """Full provider names, in the priority order given ('cuda,cpu' or ['cuda', 'cpu']).

    An unknown name is an error with a did-you-mean. A provider this onnxruntime build does
    not have is an error listing the available ones, unless `fallback` is set: then it is
    dropped with a ProviderFallbackWarning, and CPU is appended when missing so that
    something always runs.
    """
    items = providers.split(",") if isinstance(providers, str) else list(providers)
    items = [p for p in items if p.strip()] or ["cpu"]
    known = known_providers()
    wanted = list(dict.fromkeys(_full_name(p, known) for p in items))
    available = ort.get_available_providers()
    missing = [p for p in wanted if p not in available]
    if missing and not fallback:
        p = missing[0]
        raise OpscopeError(
            f"execution provider {p} is not available in this onnxruntime {ort.__version__}; "
            f"available: {', '.join(available)}",
            hint=f"{_HOW_TO_GET.get(p, 'use an onnxruntime build that has it')}, or pass --fallback "
            "to run on the available providers",
        )
    kept = [p for p in wanted if p in available]
    if CPU not in kept and (missing or not kept):
        kept.append(CPU)
    if missing:
        warnings.warn(
            f"execution provider {', '.join(missing)} not available in this onnxruntime "
            f"{ort.__version__}; running on {', '.join(kept)}",
            ProviderFallbackWarning,
            stacklevel=2,
        )
    return kept


@dataclass
class RuntimeConfig:
    """Session-level choices that change results and speed, recorded with every run.

    `providers`: short or full names in priority order (a comma string or a list);
    `graph_opt`: onnxruntime's optimization level, all / extended / basic / disable;
    `threads`: intra-op threads (None: onnxruntime's default, one per core);
    `fallback`: drop unavailable providers instead of failing.
    """

    providers: str | Sequence[str] = "cpu"
    graph_opt: str = "all"
    threads: int | None = None
    fallback: bool = False
    # onnxruntime's memory pattern pre-plans one arena block for every intermediate. It cost a
    # tapped bert_like +49 MB while weight taps were constant-folded in the graph; with weight
    # sketches on the host it costs nothing and saves ~0.5 us per tap node (1.46x vs 1.49x plain).
    mem_pattern: bool = True
    # "default" or "priority" (onnxruntime's PRIORITY_BASED node order). With the default
    # order, a tensor given a second consumer (a tap) loses in-place reuse in the model's own
    # kernels: 64 bare Shape taps on bert_like cost 1.16x plain, 1.00x in priority order.
    execution_order: str = "default"
    profile_prefix: str | None = None  # write onnxruntime's profile (JSON) to <prefix>_<date>.json
    optimized_model: str | None = None  # save the graph onnxruntime runs there (weights beside it)

    def __post_init__(self) -> None:
        if self.graph_opt not in GRAPH_OPT_LEVELS:
            close = did_you_mean(self.graph_opt, GRAPH_OPT_LEVELS)
            choices = ", ".join(GRAPH_OPT_LEVELS)
            raise OpscopeError(
                f"unknown optimization level {self.graph_opt!r}{close}; choose one of: {choices}"
            )
        if self.execution_order not in EXECUTION_ORDERS:
            raise OpscopeError(
                f"unknown execution order {self.execution_order!r}; choose one of: {', '.join(EXECUTION_ORDERS)}"
            )
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise OpscopeError(
                f"threads {self.threads!r}: expected a positive integer (or none for the default)"
            )

    def session_options(self) -> ort.SessionOptions:
        so = ort.SessionOptions()
        so.graph_optimization_level = GRAPH_OPT_LEVELS[self.graph_opt]
        so.enable_mem_pattern = self.mem_pattern
        so.execution_order = EXECUTION_ORDERS[self.execution_order]
        if self.profile_prefix is not None:
            so.enable_profiling = True
            so.profile_file_prefix = self.profile_prefix
        if self.threads is not None:
            so.intra_op_num_threads = self.threads
        if self.optimized_model is not None:
            so.optimized_model_filepath = self.optimized_model
            # weights to a file beside it: a graph over 2 GB could not be saved, and nothing reads them
            so.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name", "weights.bin"
            )
            so.add_session_config_entry(
                "session.optimized_model_external_initializers_min_size_in_bytes", "64"
            )
        # Failures are reported by us in one line; onnxruntime's own error log would repeat
        # them as multi-line, colored text on stderr.
        so.log_severity_level = 4
        return so

    def to_record(self, session: ort.InferenceSession | None = None) -> dict[str, Any]:
        """What to store beside results: the providers actually used (the session's, when
        given), the optimization level, threads and the onnxruntime version."""
        if session is not None:
            used = list(session.get_providers())
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ProviderFallbackWarning)
                used = resolve_providers(self.providers, fallback=self.fallback)
        requested = self.providers.split(",") if isinstance(self.providers, str) else list(self.providers)
        return {
            "providers": used,
            "providers_requested": [p.strip() for p in requested if p.strip()],
            "graph_opt": self.graph_opt,
            "threads": self.threads,
            "fallback": self.fallback,
            "mem_pattern": self.mem_pattern,
            "execution_order": self.execution_order,
            "onnxruntime": ort.__version__,
        }


def for_tapped(config: RuntimeConfig) -> RuntimeConfig:
    """The session choices for an instrumented model: priority order, so the taps do not slow
    the model's own kernels (measured in BENCHMARKS.md)."""
    return dataclasses.replace(config, execution_order="priority")


# ---------------------------------------------------------------------------------------------
# Sessions


def make_session(
    model: ModelLike,
    config: RuntimeConfig | None = None,
    *,
    base_dir: str | os.PathLike | None = None,
    take_weights: bool = False,
    weights_from: ModelProto | None = None,
) -> ort.InferenceSession:
    """An InferenceSession for `model` (a path, or a ModelProto) on `config`'s providers.

    `take_weights` (a ModelProto with embedded weights only): the big initializers of the main
    graph are handed to onnxruntime as arrays instead of inside the serialized model, and the
    proto is left without their bytes (marked external, see `_move_weights`): one copy of the
    weights less at session creation. For a caller that no longer needs them (`record`).
    `weights_from`: `model` is a `graph.io.without_weight_data` copy of this proto (plus nodes of
    its own); the stubbed initializers are handed to onnxruntime as views of this proto's bytes,
    so the weights exist twice at peak (here and in onnxruntime), not four times as a deep copy
    with `take_weights` makes them (`calibration`'s passes).

    A path is handed to onnxruntime as is (it finds external data beside the file). A
    ModelProto is passed as bytes; when it refers to external data, `base_dir` (the folder
    its locations are relative to) is given to onnxruntime through a session config key,
    so no weight is copied or loaded into Python. onnxruntime builds without that key get
    the model saved to a temporary folder with hard links to the data files instead.
    A requested provider that fails to start (e.g. CUDA libraries missing) is an error,
    or a warning with `config.fallback`.
    """
    config = config or RuntimeConfig()
    providers = resolve_providers(config.providers, fallback=config.fallback)
    so = config.session_options()
    if isinstance(model, ModelProto):
        # onnxruntime copies the moved arrays while it loads the model: they must live until then
        if weights_from is not None:
            moved = _lend_weights(model, weights_from, so)
        else:
            moved = _move_weights(model, so) if take_weights and not external_files(model) else []
        session = _session_from_proto(model, so, providers, base_dir)
        del moved
    else:
        path = Path(model)
        try:
            session = ort.InferenceSession(str(path), so, providers=providers)
        except _ORT_ERRORS as exc:
            load_model(path)  # a missing, truncated or non-ONNX file gets its own clear message
            raise OpscopeError(f"{path}: onnxruntime cannot load the model: {_one_line(exc)}") from None
    _check_providers_started(session, providers, config.fallback)
    return session


def _move_weights(model: ModelProto, so: ort.SessionOptions, min_bytes: int = 64 * 1024) -> list:
    """Hand the main graph's embedded initializers of `min_bytes` or more to onnxruntime through
    `add_external_initializers`, leaving each as an external reference with no bytes.

    onnxruntime copies them into its graph before any validation or optimization, so the
    placeholder location is never opened; the returned OrtValues must outlive the session's
    creation (onnxruntime does not keep them alive). bert_like: session creation peak -10 MB.
    """
    names, values = [], []
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL or len(t.raw_data) < min_bytes:
            continue
        array = numpy_helper.to_array(t)
        t.ClearField("raw_data")
        _hand_over(t, array, names, values)
    if names:
        so.add_external_initializers(names, values)
    return values


def _hand_over(t: TensorProto, array: np.ndarray, names: list, values: list) -> None:
    """Queue `array` as initializer `t` for onnxruntime, and mark `t` external at the placeholder location."""
    values.append(ort.OrtValue.ortvalue_from_numpy(array))
    names.append(t.name)
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", _MOVED_LOCATION), ("offset", "0"), ("length", str(array.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value


def _lend_weights(model: ModelProto, source: ModelProto, so: ort.SessionOptions) -> list:
    """`_move_weights` for a stubbed copy: each initializer of `model` without bytes whose namesake in
    `source`'s main graph has them goes to onnxruntime as a zero-copy view of those bytes."""
    stubs = {t.name: t for t in model.graph.initializer if not t.raw_data and t.data_location != TensorProto.EXTERNAL
             and not _has_typed_data(t)}  # fmt: skip
    names, values = [], []
    for t in source.graph.initializer:
        stub = stubs.get(t.name)
        if stub is None or not t.raw_data or sys.byteorder != "little":
            continue
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        _hand_over(stub, np.frombuffer(t.raw_data, dtype=dtype).reshape(tuple(t.dims)), names, values)
    if names:
        so.add_external_initializers(names, values)
    return values


def _has_typed_data(t: TensorProto) -> bool:
    return any(len(getattr(t, f)) for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                                            "string_data"))  # fmt: skip


def _session_from_proto(
    model: ModelProto, so: ort.SessionOptions, providers: list[str], base_dir: str | os.PathLike | None
) -> ort.InferenceSession:
    external = [f for f in external_files(model) if f != _MOVED_LOCATION]
    if external:
        if base_dir is None:
            raise OpscopeError(
                "the model's weights are in external data files but no base_dir was given to find them",
                hint="pass base_dir= the folder of the original .onnx file",
            )
        check_external_data(model, base_dir)
        so.add_session_config_entry(_EXTERNAL_FOLDER_KEY, str(Path(base_dir).resolve()))
    if model.ByteSize() > _PROTO_LIMIT:  # protobuf cannot serialise it: go through a file
        return _session_via_folder(model, so, providers, base_dir)
    try:
        return ort.InferenceSession(model.SerializeToString(), so, providers=providers)
    except _ORT_ERRORS as exc:
        if external and "xternal data" in str(exc):  # an onnxruntime without the folder key
            return _session_via_folder(model, so, providers, base_dir)
        raise OpscopeError(f"onnxruntime cannot load the model: {_one_line(exc)}") from None


def _session_via_folder(
    model: ModelProto, so: ort.SessionOptions, providers: list[str], base_dir: str | os.PathLike | None
) -> ort.InferenceSession:
    with tempfile.TemporaryDirectory(prefix="opscope-", ignore_cleanup_errors=True) as tmp:
        path = save_model(model, Path(tmp) / "model.onnx", base_dir=base_dir)  # hard links, no copy
        try:
            return ort.InferenceSession(str(path), so, providers=providers)
        except _ORT_ERRORS as exc:
            raise OpscopeError(f"onnxruntime cannot load the model: {_one_line(exc)}") from None


def _check_providers_started(session: ort.InferenceSession, providers: list[str], fallback: bool) -> None:
    started = session.get_providers()
    failed = [p for p in providers if p not in started]
    if not failed:
        return
    message = (
        f"execution provider {', '.join(failed)} is installed but did not start (onnxruntime ran the "
        f"session on {', '.join(started)})"
    )
    if not fallback:
        raise OpscopeError(
            message, hint="check its libraries (e.g. CUDA/cuDNN versions), or pass --fallback to accept this"
        )
    warnings.warn(message, ProviderFallbackWarning, stacklevel=3)


def session_signature(session: ort.InferenceSession) -> list[InputSpec]:
    """The session's inputs as InputSpec, to check feeds against what onnxruntime will accept."""
    return [_spec_of_arg(a) for a in session.get_inputs()]


_ORT_TYPES = {
    "float": np.float32,
    "double": np.float64,
    "float16": np.float16,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "bool": np.bool_,
}


def _spec_of_arg(arg: Any) -> InputSpec:
    m = re.fullmatch(r"tensor\((\w+)\)", arg.type)
    dtype = np.dtype(_ORT_TYPES[m.group(1)]) if m and m.group(1) in _ORT_TYPES else None
    type_name = dtype.name if dtype is not None else (m.group(1) if m else arg.type)
    dims = None
    if m and arg.shape is not None:
        dims = [d if isinstance(d, str) or d is None else (int(d) if d > 0 else None) for d in arg.shape]
    return InputSpec(arg.name, dtype, dims, type_name)


# ---------------------------------------------------------------------------------------------
# Running


def run(
    session: ort.InferenceSession,
    feeds: Mapping[str, np.ndarray],
    output_names: Sequence[str] | None = None,
) -> list[np.ndarray]:
    """`session.run`, with feeds checked first and onnxruntime failures turned into one line.

    A failure inside the model names the node onnxruntime names (the innermost one when
    the node sits in an If/Loop body) and the feeds it was given.
    """
    signature, outputs = _described(session)
    check_feeds(signature, feeds)
    if output_names is not None and not outputs.issuperset(output_names):
        known = [o.name for o in session.get_outputs()]
        name = next(n for n in output_names if n not in outputs)
        raise OpscopeError(
            f"output {name!r} is not an output of the model{did_you_mean(name, known)}; outputs: {listing(known)}"
        )
    try:
        return session.run(list(output_names) if output_names is not None else None, dict(feeds))
    except _ORT_ERRORS as exc:
        raise _run_error(exc, feeds) from None


_DESCRIBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _described(session: ort.InferenceSession) -> tuple[list[InputSpec], frozenset[str]]:
    """The session's input signature and output names, read once per session: a tapped model has hundreds
    of outputs, and get_outputs() plus a list lookup per name cost 3 ms a batch on 624 of them."""
    try:
        got = _DESCRIBED.get(session)
    except TypeError:  # not weakly referable (a wrapper): read it each time
        got = None
    if got is None:
        got = (session_signature(session), frozenset(o.name for o in session.get_outputs()))
        with contextlib.suppress(TypeError):
            _DESCRIBED[session] = got
    return got


_NODE = re.compile(r"running (\w+) node\. Name:'([^']*)'")


def _one_line(exc: BaseException) -> str:
    """onnxruntime's message without its code prefix, source paths, C++ signatures and line breaks."""
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", str(exc).strip())
    if "Status Message:" in text:
        text = text.rsplit("Status Message:", 1)[1]
    text = re.sub(r"\S+\.(?:h|cc|cpp|hpp|cu|c):\d+\s+", "", text)
    if " was false. " in text:  # an assertion: the condition is internal, the rest is the reason
        text = text.split(" was false. ", 1)[1]
    else:
        text = re.sub(r"^[\w:<>,*& ]*?[\w>]+::~?\w+\([^)]*\)\s*(?:const\s*)?", "", text.strip())
    return " ".join(text.split()) or " ".join(str(exc).split())


def _run_error(exc: BaseException, feeds: Mapping[str, np.ndarray]) -> OpscopeError:
    raw = str(exc)
    detail = _one_line(exc)
    fed = describe_feeds(feeds)
    nodes = _NODE.findall(raw)
    if not nodes:
        return OpscopeError(
            f"onnxruntime rejected the feeds ({fed}): {detail}",
            hint="check the input shapes and values (--shape, --dim, --value, --range)",
        )
    op, name = nodes[-1]
    where = f"node {name!r} ({op})" if name else f"a {op} node"
    if len(nodes) > 1:
        where += f" inside {nodes[0][0]} {nodes[0][1]!r}"
    shape_trouble = re.search(r"broadcast|dimension|shape|size", detail, re.IGNORECASE)
    images = [k for k, v in feeds.items() if np.ndim(v) == 4]
    if shape_trouble and images:
        hint = (
            f"the input size may not suit the model: image models often need H and W to be multiples of "
            f"their stride (often 32); try e.g. --shape {images[0]}:"
            + ",".join(map(str, _round_hw(np.shape(feeds[images[0]]))))
        )
    elif shape_trouble:
        hint = "the input shapes may not suit the model: set them with --shape / --dim"
    else:
        hint = "check the input values (--value, --range, --dist), or try --opt-level disable"
    return OpscopeError(f"the model itself failed in {where} on feeds {fed}: {detail}", hint=hint)


def _round_hw(shape: tuple[int, ...], stride: int = 32) -> list[int]:
    return [*shape[:-2], *(max(stride, round(d / stride) * stride) for d in shape[-2:])]
