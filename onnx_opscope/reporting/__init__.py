"""The report: findings, the commands that act on them, signals, rules and plots, as HTML or Markdown.

`plots` draws the figures (matplotlib, Agg canvas, no display); `weights` the weight plans'
section (error against bytes per layer, the allocators' frontier); `decoder` the Decoder section of a
`generate` table (its decoder findings per kind, max|x| per layer and phase); `render` lays out the page and
writes it (`report`, and `write_weights_report` for the weights section alone).
"""

from .plots import Plot, make_plots
from .render import report, write_weights_report

__all__ = ["Plot", "make_plots", "report", "write_weights_report"]
