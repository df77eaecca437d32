"""The report: findings, the commands that act on them, signals, rules and plots, as HTML or Markdown.

`plots` draws the figures (matplotlib, Agg canvas, no display); `render` lays out the page and
writes it (`report`).
"""

from .plots import Plot, make_plots
from .render import report

__all__ = ["Plot", "make_plots", "report"]
