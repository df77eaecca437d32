"""onnx-opscope: where the work goes in an ONNX model, what its hot tensors look like, what pays off.

The public API: each function is one call for what its `opscope` command does.

    analyze(model)                     static per-op cost, roofline, roll-ups      (opscope analyze)
    per_token(decoder, seq=, past=)  FLOPs and bytes per token of prefill and decode, KV bytes
                                       per token, their roofline classes  (opscope analyze --decoder)
    profile_nodes(model)               measured time per node, fused kernels mapped back, measured
                                       roofline verdicts, region times        (opscope analyze --profile)
    inject(model, sites, sketches)     instrumented model + manifest               (opscope inject)
    keep_kernels(model, sites_of(model), RuntimeConfig())  the sites without taps that would
                                       change onnxruntime's integer kernels (record and the CLI do it)
    record(model, out=..., feeds=...)  run batches, write the sketch table         (opscope record)
    generate(decoder, prompt, steps=...)  KV-cache loop, prefill/decode steps recorded (opscope generate)
    prompt_ids_of(text, decoder)       a text prompt's ids by the tokenizer.json beside the decoder, for
                                       any *_generation's prompt; text_of(ids, decoder) (generate --prompt)
    read_table(path)                   a sketch table: a folder of parts, a killed run's too
    mine(table)                        findings: signals, rules, plan              (opscope mine)
    mine_decoder(table)                a `generate` table's findings per layer and phase: massive
                                       activations, sinks, KV ranges, drift   (opscope mine --decoder)
    report(table, out_path)            Markdown / HTML report with plots           (opscope report)
    parity(a, b) / parity(a, providers=...)  outputs and first diverging layer     (opscope parity)
    parity_generation(a, b, prompt, steps=)  two decoders over one generated sequence, B fed A's
                                       tokens: top-1, KL, diverging layer per step (opscope parity --generate)
    calibrate(model, feeds)            quantization ranges of what quantize_static calibrates
                                       (opscope calibrate); caches and QDQ: calibration.export
    calibrate_generation(decoder, prompt, steps=)  the same over a KV loop's prefill and decode steps
                                       (opscope calibrate --generate)
    survey(models, record=False)       analyze (and record) many models, a row each (opscope zoo)
    probe_weights(model)               per-weight probes and hints                 (opscope weights)
    plan_weights(model, budgets=...)   per-layer menus, allocators per byte budget, each plan
                                       applied and scored end to end              (opscope weights --plan)
    apply_weight_plan(model, plan)     the plan stored in the model               (opscope rewrite weights)
    fake_quant(model) / skip_blocks(model, adds)  rewrites, typed results          (opscope rewrite)
    write_rewrite(model, rewritten, out)  save it and score it against the model
    LiveRecorder(session, every=N)     a serving session sampled into bounded online sketches:
                                       .summary(), .findings() (memoize, drift), .save(path)
    GuardedMemo(session, capacity=...)  outputs cached behind a hash and an exact-bytes check

Names are imported on first use, so `import onnx_opscope` stays cheap (no onnxruntime,
pyarrow or matplotlib until a function that needs them is called).

The package follows the pipeline, each layer importing only from layers below it:
errors -> files -> graph -> shapes -> sites -> weights -> sketch -> instrument -> transform -> compare -> run ->
calibration -> analysis -> findings -> reporting -> cli (tests/test_layout.py holds the code to it). Packages
are nouns and API functions verbs (`analysis` holds `analyze`, `findings` holds `mine`):
a package named like a function would rebind `onnx_opscope.<name>` to itself on import.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = {
    "OpscopeError": "errors",
    "load_model": "graph",
    "save_model": "graph",
    "Selection": "sites",
    "find_sites": "sites",
    "SketchOptions": "sketch",
    "inject": "instrument",
    "inject_file": "instrument",
    "sites_of": "instrument",
    "decode": "instrument",
    "host_values": "instrument",
    "load_manifest": "instrument",
    "probe_weights": "weights",
    "apply_weight_plan": "transform",
    "fake_quant": "transform",
    "skip_blocks": "transform",
    "compare_outputs": "compare",
    "FeedSpec": "run",
    "RuntimeConfig": "run",
    "make_session": "run",
    "keep_kernels": "run",
    "record": "run",
    "generate": "run",
    "prompt_ids_of": "run.prompt",
    "text_of": "run.prompt",
    "read_table": "run",
    "parity": "run",
    "parity_generation": "run",
    "validate_skips": "run",
    "write_rewrite": "run",
    "plan_weights": "run",
    "Engine": "run",
    "LiveRecorder": "run",
    "GuardedMemo": "run",
    "survey": "analysis.survey",
    "calibrate": "calibration",
    "calibrate_generation": "calibration",
    "analyze": "analysis",
    "profile_nodes": "analysis.costs",
    "find_motifs": "analysis",
    "per_token": "analysis.decoder",
    "MineConfig": "findings",
    "mine": "findings",
    "mine_decoder": "findings",
    "load_findings": "findings",
    "save_findings": "findings",
    "report": "reporting",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'onnx_opscope' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
