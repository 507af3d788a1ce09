"""``tokenmill bench``: tokenmill and its peers on one store, with the same sampling, in one run.

Every contender draws batches of random seq_len-token windows (inputs, and targets shifted by
one) from the same store with the same seed, each in its own worker process, so that time to
first batch and peak RSS are its own. ``contenders`` registers the loaders, ``measure`` is what a
child measures, ``runner`` starts the children and watches their memory, ``report`` prints the
table, ``command`` is the command line.

    report = run("store/", seq_len=2048, batch_size=8)
    print(format_report(report))
"""

from tokenmill.observe.bench.command import add_arguments, run_from_args
from tokenmill.observe.bench.contenders import (BASELINE, CONTENDERS, NOTES, REQUIRES, TOKENMILL_SETTINGS,
                                                Factory, WindowDataset, contender, naive_batches,
                                                nanogpt_batches)
from tokenmill.observe.bench.measure import (WORK_FLOATS, calibrate_step, child_result, measure,
                                             measure_or_skip, measure_steps, serve_one, slowdown,
                                             step_times, step_work, tokens_per_s)
from tokenmill.observe.bench.report import format_report, format_table, write_plot
from tokenmill.observe.bench.runner import machine, report_notes, run, run_child, select, watch

__all__ = [
    "BASELINE", "CONTENDERS", "Factory", "NOTES", "REQUIRES", "TOKENMILL_SETTINGS", "WORK_FLOATS",
    "WindowDataset", "add_arguments", "calibrate_step", "child_result", "contender",
    "format_report", "format_table", "machine", "measure", "measure_or_skip", "measure_steps",
    "naive_batches", "nanogpt_batches", "report_notes", "run", "run_child", "run_from_args",
    "select", "serve_one", "slowdown", "step_times", "step_work", "tokens_per_s", "watch", "write_plot",
]
