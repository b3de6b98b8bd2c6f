"""The largest batch that fits on one device, per mode (plain training, GradCache, ...): the search
shared by the GPU batch benchmarks (decoder_lora_bench, qwen_vl_chunks --gpu), re-exported by `harness`.

`search_each_mode` gives each mode in turn a fresh trainer, its share of the time left and a
`doubling_search` from the smaller of the start batch and what earlier modes fitted (so the modes
share a row at the smaller largest batch); a `SearchLog` writes the rows as they come;
`finish_modes` draws them (`plot_batch_search`: samples/s and peak memory against the batch),
prints the summary and fails the run when a mode ended in an error.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._harness_results import pyplot, write_results

Row = dict[str, Any]


@dataclasses.dataclass
class SearchLog:
    """A batch search's rows (one per measured batch: `mode`, `batch`, `status`, `samples_per_s`,
    `cuda_peak_gib`, ...) and how each mode's search ended, written to `out`/`name`.{json,csv} after
    every row and mode (a killed run keeps what it measured) and drawn at the end. The JSON holds
    `setup`, `summarize(rows, ends)` and the ends; `note(row)` adds to a row's printed line."""

    out: Path
    name: str
    meta: dict[str, Any]
    fields: list[str]
    modes: Sequence[str]
    title: str
    summarize: Callable[[list[Row], dict[str, Row]], Row]
    setup: Row
    note: Callable[[Row], str] = lambda row: ""
    rows: list[Row] = dataclasses.field(default_factory=list)
    ends: dict[str, Row] = dataclasses.field(default_factory=dict)

    def save(self, figure: bool = False) -> None:
        payload = {**self.setup, "summary": self.summarize(self.rows, self.ends), "modes": self.ends}
        draw = (lambda: plot_batch_search(self.rows, self.modes, self.title)) if figure and self.rows else None
        write_results(self.out, self.name, self.meta, payload, rows=self.rows, fields=self.fields, figure=draw)

    def record(self, row: Row) -> None:
        self.rows.append(row)
        rate = f"{row['samples_per_s']:.2f} samples/s" if row["status"] == "ok" else row["status"]
        peak = f", peak {row['cuda_peak_gib']:.2f} GiB" if row.get("cuda_peak_gib") is not None else ""
        print(f"{row['mode']} batch {row['batch']}: {rate}{peak}{self.note(row)}", flush=True)
        self.save()


def search_each_mode(
    log: SearchLog,
    *,
    build: Callable[[str], Any],
    search: Callable[[str, Any, int, float | None], Row],
    start_batch: int,
    device: torch.device,
    start: float,
    time_budget: float,
) -> None:
    """Per mode of `log.modes`, in order: `build(mode)` a trainer, then `log.ends[mode] = search(mode,
    trainer, first batch, deadline)` (the search records its rows with `log.record`), the deadline an
    equal share of what is left of `time_budget` seconds from `start` (0: none); the trainer is
    closed and freed before the next mode. Each end also gets the CUDA memory still allocated when
    its mode began (what earlier modes left)."""
    cuda = device.type == "cuda"
    for i, mode in enumerate(log.modes):
        deadline = None
        if time_budget:
            now = time.monotonic()
            deadline = now + (start + time_budget - now) / (len(log.modes) - i)
        before = torch.cuda.memory_allocated(device) / 2**30 if cuda else None
        trainer = build(mode)
        try:
            fits = [r["batch"] for r in log.rows if r["status"] == "ok"]  # earlier modes'
            log.ends[mode] = search(mode, trainer, min([start_batch, *fits]), deadline)
        finally:
            trainer.metrics.close()
            del trainer
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        log.ends[mode]["cuda_allocated_before_gib"] = before
        print(f"{mode}: {log.ends[mode]['stop']}", flush=True)
        log.save()


def finish_modes(log: SearchLog, summary_lines: Callable[[Row], list[str]], start: float) -> None:
    """Write the results with their figure, print `summary_lines(summary)` and where they went;
    SystemExit naming each mode whose search ended in an error."""
    log.save(figure=True)
    for line in summary_lines(log.summarize(log.rows, log.ends)):
        print(line)
    print(f"wrote {log.out}/{log.name}.json, .csv and .png ({time.monotonic() - start:.0f} s)")
    errors = [f"{mode}: {end['stop']}" for mode, end in log.ends.items() if end["stop"].startswith("error")]
    if errors:
        raise SystemExit("; ".join(errors))


def doubling_search(
    start: int,
    measure: Callable[[int], dict[str, Any]],
    *,
    smallest: int,
    largest: int,
    deadline: float | None,
    seconds_for: Callable[[dict[str, Any], int], float],
    device: torch.device,
) -> dict[str, Any]:
    """The largest batch that fits: `measure(batch)` (which records its row) from `start`, doubling
    while the row's status is "ok"; a start that runs out of memory ("OOM") is halved until one fits
    (down to `smallest`); "error" ends the search, as do `largest` and the `deadline` (before a batch,
    `seconds_for(the previous row, batch)` must fit in what is left). Returns {"stop": why it ended}."""
    batch, going_down, previous = start, False, None
    while True:
        if batch > largest:
            return {"stop": f"max batch {largest}"}
        if deadline is not None and time.monotonic() >= deadline:
            return {"stop": "time budget: no time left"}
        if deadline is not None and previous is not None:
            needed, left = seconds_for(previous, batch), deadline - time.monotonic()
            if needed > left:
                return {"stop": f"time budget: batch {batch} needs ~{needed:.0f} s, {max(left, 0):.0f} s left"}
        row = measure(batch)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if row["status"] == "error":
            return {"stop": f"error at batch {batch}: {row.get('reason')}"}
        if row["status"] == "OOM":
            if previous is not None or batch <= smallest:
                return {"stop": f"out of memory at batch {batch}"}
            batch, going_down = max(smallest, batch // 2), True  # the start does not fit: halve until one does
            continue
        if going_down:
            return {"stop": f"out of memory at batch {batch * 2}"}
        previous, batch = row, batch * 2


def plot_batch_search(rows: Sequence[Mapping[str, Any]], modes: Sequence[str], title: str) -> Any:
    """A batch search's figure: samples/s and peak memory against the batch, a line per mode of
    its "ok" rows (`batch`, `samples_per_s`, `cuda_peak_gib` or `peak_rss_mib`), a dotted line at
    each batch that ran out of memory."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    memory_key = "cuda_peak_gib" if any(r.get("cuda_peak_gib") is not None for r in rows) else "peak_rss_mib"
    for mode in modes:
        ok = sorted((r for r in rows if r["mode"] == mode and r["status"] == "ok"), key=lambda r: r["batch"])
        if not ok:
            continue
        (line,) = ax1.plot([r["batch"] for r in ok], [r["samples_per_s"] for r in ok], "o-", label=mode)
        ax2.plot([r["batch"] for r in ok], [r[memory_key] for r in ok], "o-", color=line.get_color(), label=mode)
        for r in rows:
            if r["mode"] == mode and r["status"] == "OOM":
                ax1.axvline(r["batch"], color=line.get_color(), ls=":", lw=1)
                ax2.axvline(r["batch"], color=line.get_color(), ls=":", lw=1, label=f"{mode} OOM")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("contrastive batch (samples)")
        ax.legend(fontsize=8)
    ax1.set_ylabel("samples/s (median)")
    ax2.set_ylabel("peak CUDA memory (GiB)" if memory_key == "cuda_peak_gib" else "peak RSS (MiB)")
    fig.suptitle(title, fontsize=9)
    return fig
