"""Findings: what a sketch table says can be exploited, per (site, role), with a guard and a benefit.

- `series`: the tidy table split into series (all steps of one run, site and role);
- `signals`: scale-free signals per step, and what a series of steps says;
- `rules` and `inference`: the rules of each site kind (the gemm cascade, attention, routing,
  residual blocks), thresholds in `config.MineConfig`;
- `miner`: `mine`, one `finding.Finding` per (run, site, role), ranked;
- `decoder`: per layer and phase of a `generate` table: massive activations, attention sinks and
  windows, KV-cache ranges and outlier channels, prefill -> decode drift (`mine` adds them);
- `plan`: estimated and measured speed-ups, FLOP share and savings;
- `finding` (JSON) and `show` (terminal): the findings written out;
- `identity`: what findings and costs came from, checked against the table they are used with.
"""

from .actions import (
    Step,
    feed_flags,
    findings_line,
    fix_first,
    next_step,
    next_steps,
    rule_counts,
    top_actions,
)
from .config import MineConfig, config_with, describe
from .decoder import decoder_findings, mine_decoder, step_phases
from .finding import FORMAT, Finding, Temporal, findings_to_dict, load_findings, read_findings, save_findings
from .identity import SourceWarning, check_costs, check_findings, findings_source
from .miner import finding_for, mine, mine_series, rank
from .plan import Costs, load_costs
from .rules import DENSE, RULE_SKETCHES, RULES, unchecked_rules
from .series import Series, collect, read_sketch_table
from .show import measure_notes, print_findings, shown_findings, temporal_text
from .signals import SIGNALS, hist_gaps, rel_dist, step_signals, temporal_signals

__all__ = [
    "DENSE",
    "FORMAT",
    "RULES",
    "RULE_SKETCHES",
    "SIGNALS",
    "SourceWarning",
    "Costs",
    "Finding",
    "MineConfig",
    "Series",
    "Temporal",
    "check_costs",
    "check_findings",
    "collect",
    "config_with",
    "decoder_findings",
    "describe",
    "finding_for",
    "findings_source",
    "findings_to_dict",
    "hist_gaps",
    "load_costs",
    "load_findings",
    "mine",
    "mine_decoder",
    "mine_series",
    "print_findings",
    "shown_findings",
    "measure_notes",
    "rank",
    "read_findings",
    "read_sketch_table",
    "rel_dist",
    "save_findings",
    "step_phases",
    "step_signals",
    "temporal_signals",
    "temporal_text",
    "unchecked_rules",
    "Step",
    "feed_flags",
    "findings_line",
    "fix_first",
    "next_step",
    "next_steps",
    "rule_counts",
    "top_actions",
]
