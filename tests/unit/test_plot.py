"""`rl plot`: the panels users compare runs on, overlaid, with runs that did not log a metric left out of
that panel rather than drawn as zeros."""

import json

from rlx.orchestrate.metrics import PANELS, plot


def write_run(folder, kl: bool):
    folder.mkdir(parents=True)
    rows = [{"step": i, "reward/mean": 0.1 * i, "kl": 0.01 * i if kl else None, "entropy": 2.0 - 0.1 * i,
             "response_len/mean": 10 + i, "train_rollout_logprob_diff": 1e-7 * i, "tokens": 100 * i,
             "time/rollout_s": 0.1, "time/train_s": 0.2, "time/weight_sync_s": 0.05, "time/step_s": 0.4}
            for i in range(1, 6)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if kl:  # this run also evaluated: two datasets at steps 0 and 5, and an `rl eval` row that is not plotted
        evals = [{"step": s, "dataset": d, "pass@1": 0.1 * s + (d == "b")} for s in (0, 5) for d in ("a", "b")]
        evals.append({"step": 5, "dataset": "a", "pass@1": 0.9, "checkpoint": "/x"})
        (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    return folder


def test_panels_overlay_runs_and_skip_what_a_run_did_not_log(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = write_run(tmp_path / "with-kl", kl=True), write_run(tmp_path / "no-kl", kl=False)
    saved = {}
    real_savefig = plt.Figure.savefig

    def keep(fig, *args, **kwargs):
        saved["fig"] = fig
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    out = plot([a, b], tmp_path / "curves.png")
    assert out.stat().st_size > 10_000
    axes = {ax.get_title(): ax for ax in saved["fig"].axes}
    assert list(axes) == [title for title, *_ in PANELS]
    assert [line.get_label() for line in axes["KL to the reference"].lines] == ["with-kl"]
    assert [line.get_label() for line in axes["mean reward"].lines] == ["with-kl", "no-kl"]
    assert axes["trainer vs engine log-prob diff"].get_yscale() == "log"
    throughput = axes["throughput (tokens/s)"].lines[0].get_ydata()
    assert list(throughput) == [250.0, 500.0, 750.0, 1000.0, 1250.0]  # tokens / seconds per step
    assert len(axes["seconds per step"].lines) == 6  # rollout, train, sync for each run
    evals = axes["eval pass@1 (held-out)"]
    assert [line.get_label() for line in evals.lines] == ["with-kl a", "with-kl b"]
    assert list(evals.lines[0].get_xdata()) == [0, 5] and list(evals.lines[1].get_ydata()) == [1.0, 1.5]
