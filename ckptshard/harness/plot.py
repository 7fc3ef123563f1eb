"""The report as a picture: per-step losses of the uninterrupted and each resumed run, and their relative
difference on a log axis, one column per recipe (matplotlib, an optional dependency)."""

from __future__ import annotations

from typing import Dict, List, Sequence

from ..errors import CheckpointError
from .verify_resume import Result

EXACT_FLOOR = 1e-17  # where a bit-exact step is drawn on the log axis


def check_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CheckpointError("--plot needs matplotlib: pip install 'ckptshard[plot]'") from None


def plot_results(results: Sequence[Result], path: str) -> None:
    """Write ``path`` (PNG): losses on top, |resumed - uninterrupted| / |uninterrupted| per step below."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    by_recipe: Dict[str, List[Result]] = {}
    for r in results:
        if r.applicable and r.resumed_losses:
            by_recipe.setdefault(r.recipe, []).append(r)
    if not by_recipe:
        raise CheckpointError("--plot: no scenario trained any step to draw")
    cols = len(by_recipe)
    fig, axes = plt.subplots(
        2, cols, figsize=(6 * cols, 7), sharex="col", squeeze=False, gridspec_kw={"height_ratios": [3, 2]}
    )
    for col, (recipe, runs) in enumerate(by_recipe.items()):
        top, bottom = axes[0][col], axes[1][col]
        drawn = set()
        for r in runs:
            ref = r.reference_losses
            if tuple(ref) not in drawn:
                drawn.add(tuple(ref))
                label = "uninterrupted" if len(drawn) == 1 else None
                top.plot(range(1, len(ref) + 1), ref, color="black", linewidth=4, alpha=0.3, label=label)
                top.axvline(r.first_step + 0.5, color="grey", linewidth=0.5, linestyle=":")
            steps = range(r.first_step + 1, r.first_step + 1 + len(r.resumed_losses))
            style = "--" if r.expected_match else ":"
            line = top.plot(
                steps, r.resumed_losses, style, marker="o", markersize=3, label=f"{r.scenario}: {r.verdict}"
            )
            rel = [
                max(abs(b - a) / max(abs(a), 1e-30), EXACT_FLOOR) for a, b in zip(ref[r.first_step :], r.resumed_losses)
            ]
            bottom.plot(steps, rel, style, marker="o", markersize=3, color=line[0].get_color())
        bottom.set_yscale("log")
        bottom.set_ylim(EXACT_FLOOR / 10, 10)
        bottom.axhline(EXACT_FLOOR, color="grey", linewidth=0.5)
        bottom.text(0.01, 0.02, "bottom line: bit-exact", transform=bottom.transAxes, fontsize=8, color="grey")
        bottom.set_ylabel("|resumed - uninterrupted| / |uninterrupted|")
        bottom.set_xlabel("step (dotted: where the resumed runs start)")
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
        top.set_ylabel("loss of the global batch")
        top.set_title(f"verify-resume: {recipe}", fontsize=10)
        handles, labels = top.get_legend_handles_labels()
        bottom.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
