"""Answer normalisation, QA matchers, token F1 and the rubric outcome, against hand values."""
import pytest

from megatron_search.rewards import exact_match, normalize_answer, qa_reward, rubric_reward, substring_match, token_f1


@pytest.mark.parametrize(
    "raw, norm",
    [
        ("The Mom Test", "mom test"),
        ("  U.S.  of\tAMERICA!! ", "us of america"),
        ("an apple, a pear and THE plum.", "apple pear and plum"),
        ("Theatre", "theatre"),  # articles only as whole words
        ("rock-and-roll", "rockandroll"),
        ("«Straße»", "strasse"),  # Unicode punctuation and case folding
        ("¿Qué?", "qué"),
        ("", ""),
    ],
)
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_exact_and_substring_match():
    assert exact_match("the Mom Test.", "The Mom Test")
    assert not exact_match("The Mom Test by Rob", "The Mom Test")
    assert substring_match("I think it is The Mom Test, by Rob.", "the mom test")
    assert not substring_match("concatenate", "cat")  # word boundaries
    assert substring_match("Paris", ["Lutetia", "paris"])  # any alias
    assert not substring_match("", "paris")


def test_token_f1_by_hand():
    # pred words: big cat | gold words: cat sat; overlap 1: P = 1/2, R = 1/2
    assert token_f1("The big cat", "a cat sat") == pytest.approx(0.5)
    # pred: cat cat mat (3), gold: cat mat mat sat (4); overlap min counts: cat 1 + mat 1 = 2
    assert token_f1("cat cat mat", "cat mat mat sat") == pytest.approx(2 * (2 / 3) * (2 / 4) / (2 / 3 + 2 / 4))
    assert token_f1("dog", "cat") == 0.0
    assert token_f1("", "cat") == 0.0
    assert token_f1("x", ["y", "x z"]) == pytest.approx(2 / 3)  # best alias: P 1, R 1/2


def test_qa_reward_modes():
    assert qa_reward("It was The Mom Test.", "The Mom Test") == 1
    assert qa_reward("It was The Mom Test.", "The Mom Test", mode="exact") == 0
    assert qa_reward("The Mom Test", "The Mom Test", mode="exact") == 1
    assert qa_reward(None, "The Mom Test") == 0
    with pytest.raises(ValueError, match="answer_match: 'fuzzy'"):
        qa_reward("x", "x", mode="fuzzy")


def test_bad_gold_is_rejected():
    with pytest.raises(ValueError, match=r"gold: reference answer 'The\.' is empty after normalisation"):
        substring_match("anything", "The.")
    with pytest.raises(ValueError, match="gold: no reference answer"):
        exact_match("x", [])
    with pytest.raises(ValueError, match="empty after normalisation"):
        qa_reward(None, "  ")
    with pytest.raises(TypeError, match="answer: expected str"):
        normalize_answer(3)


def test_rubric_reward_all_must_pass():
    assert rubric_reward([True, True, True]) == 1
    assert rubric_reward([True, False, True]) == 0
    with pytest.raises(ValueError, match="rubrics: empty rubric set"):
        rubric_reward([])
    with pytest.raises(TypeError, match="rubrics: result 1 is int"):
        rubric_reward([True, 1])
