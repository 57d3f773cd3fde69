"""The demo report's strategy table, pass@k and figures, on rows written by hand."""
import pytest

from megatron_search.demo.report import pass_at_k, plot_curves, strategy_table


def _row(qid, sample, correct, queries=()):
    return {"id": qid, "sample": sample, "grade": "CORRECT" if correct else "INCORRECT", "queries": list(queries)}


def test_pass_at_k_by_hand():
    rows = [_row("a", 0, False), _row("a", 1, True), _row("a", 2, True),  # a has 3 samples: only 2 count
            _row("b", 1, False), _row("b", 0, False),
            _row("c", 0, True), _row("c", 1, False)]
    got = pass_at_k(rows)
    # k = 2: a -> [F, T] passes, b fails, c passes; per-sample 2 right of 6
    assert got == {"k": 2, "questions": 3, "pass_at_k": 2 / 3, "pass_at_1": 2 / 6}
    assert pass_at_k([])["pass_at_k"] is None


def test_strategy_table_by_hand():
    subjects = {"q1": "Zorblat", "q2": "Quenix Hall"}
    rows = [_row("q1", 0, True, ["zorblat"]), _row("q1", 1, False, []), _row("q2", 0, True, ["Quenix Hall", "x"]),
            _row("q2", 1, False, ["person wrote"])]
    t = strategy_table(rows, subjects)
    assert {k: v["share"] for k, v in t.items()} == {"search": 0.25, "altered": 0.0, "no_search": 0.25, "miss": 0.25,
                                                    "redundant": 0.25}
    assert t["search"]["accuracy"] == 1.0 and t["no_search"]["accuracy"] == 0.0 and t["redundant"]["accuracy"] == 1.0
    assert t["altered"]["accuracy"] is None
    assert strategy_table([_row("q1", 0, True, [])], subjects)["search"]["accuracy"] is None
    with pytest.raises(KeyError, match="q9"):
        strategy_table([_row("q9", 0, True)], subjects)


def test_plot_curves_writes_the_figures_with_data(tmp_path):
    series = {"reward/r_base": [(0, 0.1), (1, 0.3)], "reward/pen_tool": [(0, 0.2), (1, 0.1)]}
    written = plot_curves(series, tmp_path)
    assert sorted(p.name for p in written) == ["grpo_penalties.png", "grpo_rewards.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
    assert plot_curves({}, tmp_path / "none") == []


def test_classify_altered_subject_by_hand():
    """A query that keeps the words coined for the subject's name but changes a shared one (an adjective, a
    suffix) is "altered"; keeping only a shared word, or only one of a person's two coined words, is a miss."""
    from megatron_search.data.demo_tasks import classify_strategy

    book, person, company = "The Distant Synunerk", "Zefafoth Vavril", "Krotork Labs"
    assert classify_strategy(["The Distant Synunerk"], book) == "search"
    assert classify_strategy(["the distant synunerk was written by"], book) == "search"
    assert classify_strategy(["The Quiet Synunerk was written by"], book) == "altered"
    assert classify_strategy(["Synunerk", "person wrote"], book) == "altered"
    assert classify_strategy(["The Distant Voshein was written by"], book) == "miss"  # a shared word only
    assert classify_strategy(["The Quiet Synunerkx"], book) == "miss"  # whole words only
    assert classify_strategy(["person wrote"], book) == "miss"
    assert classify_strategy(["Vavril Zefafoth"], person) == "altered"
    assert classify_strategy(["Zefafoth Crooked"], person) == "miss"
    assert classify_strategy(["Krotork Systems founder"], company) == "altered"
    assert classify_strategy(["Zefafoth Vavril", "Zefafoth Vavril"], person) == "redundant"
    assert classify_strategy([], person) == "no_search"
