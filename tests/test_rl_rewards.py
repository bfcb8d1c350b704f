"""Rewards: answer extraction, numeric normalisation, the registry."""

from fractions import Fraction

import pytest

from fastrl_jax.rl import rewards


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the sum is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("The answer is 17. Later I say 3.", "17"),
        ("the answer is: $1,234.50", "1,234.50"),
        ("First 3 apples, then 5 more, total 8", "8"),
        ("It is -2.5", "-2.5"),
        ("no number here", None),
        ("The answer is 7 and the answer is 9", "9"),
        ("The answer is **12**. (I checked it 3 times.)", "12"),  # markdown bold
        ("The answer is: $\\(-4\\)$.", "-4"),
        ("5 apples left after 2-3 days", "3"),  # a range's dash is no minus sign
        ("The answer is $\\frac{3}{4}$", "\\frac{3}{4}"),  # not the denominator, the last number
        ("The answer is \\(\\sqrt{2}\\).", "\\sqrt{2}"),  # stated, though no number: not the 2 inside it
        ("The two roots are 2,5", "5"),  # commas only as thousands separators
        ("so the answer is 3,4 apples", "3"),
        ("a total of 1,000,000 grains", "1,000,000"),
        ("The answer is \u22123.", "-3"),  # a Unicode minus (U+2212) is a minus, not the positive 3
        ("so x = \u22127", "-7"),
        ("The answer is \\$5. That is 2 more than before.", "5"),  # an escaped dollar before the stated answer
    ],
)
def test_extract_answer(text, expected):
    assert rewards.extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, value",
    [("1,234", 1234), ("$12.50", Fraction(25, 2)), ("3/4", Fraction(3, 4)), ("\\frac{3}{4}", Fraction(3, 4)),
     ("-0.5", Fraction(-1, 2)), ("7.", 7), ("50%", 50), ("\\dfrac{1}{2}", Fraction(1, 2)), ("abc", None), (None, None),
     ("\\$12.50", Fraction(25, 2)), ("50\\%", 50), ("\\text{7}", 7), ("12\\text{ cm}", 12), ("1\\,000", 1000),
     ("x = 5", 5), ("y=\u22123/4", Fraction(-3, 4)), ("\u22122", -2), ("x = 5, y = 3", None),
     ("\\tfrac{1}{3}", Fraction(1, 3)), ("\\frac34", Fraction(3, 4)), ("-\\frac{1}{2}", Fraction(-1, 2)),
     ("10{,}000", 10000), ("1 1/2", Fraction(3, 2)), ("3\\frac{1}{2}", Fraction(7, 2)),  # mixed: not 11/2, nor 3
     ("-2\\tfrac34", Fraction(-11, 4)), ("1 1/0", None),
     ("1e10000000", None), ("1e5", None),  # exponents: Fraction() would build 10**10000000 exactly
     ("2\\text{ and }5", None), ("\\text{x}5", None),  # units only after the number: not 25, nor 5
     ("30^\\circ", 30), ("\\frac{1}{2}\\text{ cm}", Fraction(1, 2))],
)
def test_normalize_number(text, value):
    assert rewards.normalize_number(text) == value


def test_correctness_is_numeric():
    assert rewards.correctness_reward("The answer is 12.0", "12") == 1.0
    assert rewards.correctness_reward("\\boxed{0.5}", "1/2") == 1.0
    assert rewards.correctness_reward("The answer is 13", "12") == 0.0
    assert rewards.correctness_reward("nothing", "12") == 0.0
    assert rewards.correctness_reward("\\boxed{x+1}", "x + 1") == 1.0  # non-numeric: blanks do not count (verl)
    assert rewards.correctness_reward("\\boxed{x+1}", "x+2") == 0.0


def test_separators_only_between_thousands_groups():
    """A comma or space joins digits only as a thousands separator: a boxed list of two numbers is no number."""
    assert rewards.correctness_reward("\\boxed{2, 5}", "25") == 0.0
    assert rewards.correctness_reward("\\boxed{3 4}", "34") == 0.0
    assert rewards.normalize_number("2,5") is None and rewards.normalize_number("12,3456") is None
    assert rewards.correctness_reward("\\boxed{1,234}", "1234") == 1.0
    assert rewards.correctness_reward("\\boxed{1 234 567}", "1234567") == 1.0


def test_gsm8k_ground_truth_is_the_number_after_its_last_marker():
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert rewards.correctness_reward("The answer is 72.", solution) == 1.0
    assert rewards.correctness_reward("The answer is 24.", solution) == 0.0
    assert rewards.correctness_reward("\\boxed{1,200}", "#### 1200") == 1.0


@pytest.mark.parametrize("completion", [  # verl's gsm8k prompts ask for the answer after "####"; models write on
    "She sells 16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars.\n#### 18\nQuestion: Tom has 3 apples",
    "16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18\n\nNote: step 2 used 3 eggs.",
])
def test_the_number_after_a_completions_gsm8k_marker_is_its_answer(completion):
    """verl's gsm8k scorer reads the number after the last '####'; the last number scored these 0."""
    assert rewards.correctness_reward(completion, "18") == 1.0 and rewards.format_reward(completion, "18") == 1.0


def test_a_markdown_heading_is_no_gsm8k_answer():
    """'#### 1. Count the apples' (a chat model's numbered heading) was read as the answer 1, over "The answer is",
    and earned the format reward alone."""
    completion = "#### 1. Count the apples\nThere are 3 + 4 = 7 apples.\n#### 2. Double them\n7 * 6 = 42.\n\nThe answer is 42."
    assert rewards.extract_answer(completion) == "42"
    assert rewards.format_reward("#### 1. Count the apples\nThere are 7 apples.", "7") == 0.0
    assert rewards.extract_answer("so 72 clips.\n#### 72") == "72" and rewards.extract_answer("#### $1,000.") == "1,000"


def test_a_trailing_mixed_number_is_read_whole():
    assert rewards.correctness_reward("so she has 3\\frac{1}{2} cups", "7/2") == 1.0
    assert rewards.correctness_reward("so she has 3\\frac{1}{2} cups", "1/2") == 0.0


@pytest.mark.parametrize("completion", ["9" * 4400 + " 1/2", "The answer is " + "9" * 4400 + " 1/2",
                                        "\\boxed{" + "9" * 4400 + "\\frac{1}{2}}"])
def test_a_looping_completions_digit_run_scores_instead_of_ending_the_run(completion):
    """int() refuses over 4300 digits (ValueError): one looping completion ended the training run."""
    assert rewards.correctness_reward(completion, "5") == 0.0


@pytest.mark.parametrize("completion, truth", [
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}"),  # verl strip_string's fix_sqrt
    ("\\boxed{\\sqrt{2}}", "\\sqrt2"),
    ("\\boxed{\\frac{a}{b}}", "\\frac ab"),  # its fix_fracs
    ("\\boxed{y = 2x+1}", "2x+1"),  # a short left side
    ("\\boxed{x = \\frac{\\pi}{2}}", "\\frac{\\pi}{2}"),
    ("\\boxed{2\\sqrt{3}\\text{ cm}}", "2\\sqrt{3}"),  # its remove_right_units
    ("\\boxed{5\\text{ cm}^2}", "5"),
    ("The answer is \\frac{\\sqrt{3}}{2}.", "\\frac{\\sqrt{3}}{2}"),  # nested braces in a stated answer (was '\\frac')
    ("The answer is $\\frac{1}{\\sqrt{2}}$.", "\\frac{1}{\\sqrt{2}}"),  # (was '\\frac{1}')
])
def test_symbolic_answers_equal_as_verls_strip_string_has_them(completion, truth):
    assert rewards.correctness_reward(completion, truth) == 1.0


def test_an_unboxed_fraction_is_not_its_denominator():
    assert rewards.correctness_reward("So the probability is $\\frac{3}{4}$", "4") == 0.0
    assert rewards.correctness_reward("So the probability is $\\frac{3}{4}$", "0.75") == 1.0


def test_verls_compute_score_is_called_as_verl_calls_it(tmp_path, monkeypatch):
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info) takes the record's data_source and
    extra_info (verl's files' columns, which read_records keeps) by keyword, and a dict result gives its 'score', as
    verl's reward manager reads it; it was refused for want of a two-argument wrapper. Another signature is refused at
    the start: it raised a TypeError at the first reward, after loading, compiling and a whole rollout."""
    (tmp_path / "verl_style.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    bonus = extra_info['bonus'] if extra_info else 0.0\n"
        "    if data_source == 'openai/gsm8k':\n"
        "        return {'score': float(solution_str.endswith(ground_truth)) + bonus, 'acc': True}\n"
        "    return 0.25\n"
        "def without_extra(data_source, solution_str, ground_truth):\n    return 0.5\n"
        "def three(completion, answer, extra):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = rewards.combined(("verl_style:compute_score", "verl_style:without_extra", "correct"), (1.0, 2.0, 1.0))
    record = {"answer": "4", "data_source": "openai/gsm8k", "extra_info": {"bonus": 0.5}}
    assert fn("#### 4", "4", record) == 1.5 + 1.0 + 1.0
    assert fn("#### 3", "4", {"answer": "4"}) == 0.25 + 1.0 + 0.0
    with pytest.raises(ValueError, match="must be fn\\(completion, answer\\).*compute_score"):
        rewards.combined(("verl_style:three",), (1.0,))


def test_format_reward():
    assert rewards.format_reward("The answer is 3", "3") == 1.0
    assert rewards.format_reward("\\boxed{3}", "4") == 1.0
    assert rewards.format_reward("3", "3") == 0.0
    assert rewards.format_reward("The answer is $\\frac{3}{4}$", "3/4") == 1.0
    assert rewards.correctness_reward("The answer is $\\frac{3}{4}$", "4") == 0.0
    assert rewards.correctness_reward("The answer is \\(\\frac{3}{4}\\).", "3/4") == 1.0


def test_registry_and_combination():
    fn = rewards.combined(("correct", "format"), (1.0, 0.1))
    assert fn("The answer is 5", "5", {}) == pytest.approx(1.1)
    assert fn("5", "5", {}) == pytest.approx(1.0)
    assert fn("The answer is 4", "5", {}) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="unknown reward 'nope'.*correct, format"):
        rewards.get("nope")
    with pytest.raises(ValueError, match="cannot import"):
        rewards.get("no_such_module_xyz:f")
    assert rewards.get("helpers.tiny_run:digit_reward")("a1", "") == 0.5

    @rewards.register("test_len")
    def length(completion, answer):
        return float(len(completion))

    assert "test_len" in rewards.registered() and rewards.get("test_len")("abc", "") == 3.0
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("test_len")(lambda c, a: 0.0)


def test_answer_is_scan_is_linear_in_whitespace():
    """A degenerate completion ("The answer is" then a long run of blanks) is scored in milliseconds: the
    pattern before the answer had two ways to match each blank, quadratic backtracking (16k blanks took 20 s)."""
    import time

    text = "The answer is" + " " * 8000 + "x"
    t0 = time.perf_counter()
    assert rewards.correctness_reward(text, "5") == 0.0 and rewards.format_reward(text, "5") == 0.0
    assert time.perf_counter() - t0 < 1.0
    assert rewards.extract_answer("The answer is :  **7**") == "7" and rewards.extract_answer("answer is\n\n: 7") == "7"


def test_empty_ground_truth_matches_nothing():
    """A record whose answer is blank (or a GSM8K solution ending in an empty "####") rewards no completion:
    an empty \\boxed{} matching it would teach the policy to answer nothing."""
    for truth in ("", "  ", "step one... ####", "#### "):
        assert rewards.correctness_reward("\\boxed{}", truth) == 0.0
        assert rewards.correctness_reward("\\boxed{ }", truth) == 0.0


@pytest.mark.parametrize(
    "completion, truth",
    [("\\boxed{\\text{yes}}", "yes"), ("\\boxed{yes}", "\\text{yes}"), ("\\boxed{\\text{(B)}}", "(B)"),
     ("\\boxed{\\textbf{5}}", "5"), ("\\boxed{\\mathbf{5}}", "5"), ("\\boxed{\\mathrm{Tuesday}}", "Tuesday"),
     ("\\boxed{30^\\circ}", "30"), ("\\boxed{30^{\\circ}}", "30"), ("The answer is 30\u00b0.", "30"),
     ("\\boxed{30}", "30^\\circ"), ("\\boxed{-45^\\circ}", "-45")],
)
def test_text_wrappers_and_degrees(completion, truth):
    """\\text{}/\\textbf{}/\\mathrm{}/\\mathbf{} around a whole answer is typesetting, and a degree sign a unit (as
    12\\text{ cm} is 12): both MATH-style ground truths and completions write them either way."""
    assert rewards.correctness_reward(completion, truth) == 1.0


def test_overlong_penalty_is_dapos():
    from fastrl_jax.rl.rewards import overlong_penalty

    # verl: expected = max_resp_len - buffer; min(-(length - expected) / buffer * factor, 0)
    assert [overlong_penalty(n, 100, 20, 1.0) for n in (50, 80, 90, 100)] == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(95, 100, 20, 0.5) == -0.375
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0  # off


@pytest.mark.parametrize("completion, truth, expected", [
    ("The answer is 2\\sqrt{3}.", "2", False),  # the whole stated answer, not its leading number
    ("The answer is 2\\sqrt{3}.", "2\\sqrt{3}", True),
    ("The answer is 3 1/2.", "3", False),  # a mixed number
    ("The answer is 3 1/2.", "7/2", True),
    ("The answer is 1 000.", "1000", True),
    ("The answer is 7 apples, not 8.", "7", True),
    ("The answer is B.", "B", True),  # multiple choice
    ("Option 3 fails. The answer is (B).", "B", True),
    ("The answer is (b) because the others fail.", "(B)", True),
    ("The answer is yes.", "yes", True),
    ("The answer is Yes.", "yes", True),  # read in any case, so compared in any case (review)
    ("The answer is true.", "True", True),  # a boolean column's truth (str(True))
    ("\\boxed{yes}", "True", True),
    ("\\boxed{\\text{No}}", "False", True),
    ("The answer is yes.", "False", False),
    ("The answer is 4. Checking whether the answer is correct: yes.", "4", True),  # "correct" is no answer
    ("So 9 is left, and the answer is no longer 5.", "no", False),  # a sentence goes on: no stated answer
])
def test_the_stated_answer_is_the_whole_answer(completion, truth, expected):
    """"The answer is X" (the default data.instruction's format) takes X whole: a number with its LaTeX, a mixed
    number, a choice or yes / no where the sentence ends; multiple-choice and yes / no datasets can earn a reward."""
    assert rewards.correctness_reward(completion, truth) == float(expected)


@pytest.mark.parametrize("completion, truth", [
    ("\\boxed{\\text{(A)}}", "A"), ("\\boxed{(A)}", "A"), ("\\boxed{A}", "(A)"), ("\\boxed{\\textbf{(C)}}", "C"),
    ("\\boxed{(1, 2)}", "(1,2)"), ("\\boxed{2\\sqrt{2}}", "2 \\sqrt{2}"), ("\\boxed{\\left(1,2\\right)}", "(1,2)"),
    ("\\boxed{\\dfrac{\\pi}{2}}", "\\frac{\\pi}{2}"), ("\\boxed{x \\leq 3}", "x\\leq3"),
])
def test_typesetting_does_not_count_in_symbolic_answers(completion, truth):
    """As verl's strip_string: blanks, \\left / \\right and \\dfrac against \\frac; a choice letter with or without
    its parentheses or \\text{}."""
    assert rewards.correctness_reward(completion, truth) == 1.0
    assert rewards.correctness_reward(completion, "(D)") == 0.0
