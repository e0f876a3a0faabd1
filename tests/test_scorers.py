"""The built-in GSM8K / MATH scorers (shardwise.data.scorers) against verl 0.9.1's own.

verl is installed without its dependencies (make test does it), so its package
``__init__`` (torch, ray, tensordict...) is never run: the scorer files are loaded from
their paths, and ``reward_score/__init__.py`` with its one verl import
(``verl.utils.import_utils``, stdlib only) loaded from its file too.
"""

from __future__ import annotations

import ast
import importlib.util
import pickle
import random
import sys
from pathlib import Path

import pytest
from dist.common import missing_optional

from shardwise.data.scorers import (
    SCORERS,
    SOURCE_SCORERS,
    UnknownDataSource,
    gsm8k_score,
    math_score,
    score_by_source,
)

INSTALL = 'install the reference with: pip install --no-deps "verl==0.9.1"'
PACKAGE = "_verl_reward_score_reference"  # verl.utils.reward_score, under a name of our own


def _reward_score_dir() -> Path:
    spec = importlib.util.find_spec("verl")  # finds the package without running its __init__
    folder = None
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations))) / "utils" / "reward_score"
    if folder is None or not (folder / "math_reward.py").is_file():
        missing_optional("verl", f"verl's reward_score files are not installed; {INSTALL}")
    return folder


REWARD_DIR = _reward_score_dir()


def _load(name: str, path: Path, package: bool = False):
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(path.parent)] if package else None)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


verl_gsm8k = _load("_verl_gsm8k_reference", REWARD_DIR / "gsm8k.py")
verl_math = _load("_verl_math_reward_reference", REWARD_DIR / "math_reward.py")


@pytest.fixture(scope="module")
def verl_default_compute_score():
    """verl's ``default_compute_score``, its package registered (as PACKAGE) while the
    tests run, since it imports its scorer modules relatively when called."""
    stub = "verl.utils.import_utils"
    added = [stub] if stub not in sys.modules else []
    if added:
        sys.modules[stub] = _load(stub, REWARD_DIR.parent / "import_utils.py")
    package = importlib.util.module_from_spec(importlib.util.spec_from_file_location(
        PACKAGE, REWARD_DIR / "__init__.py", submodule_search_locations=[str(REWARD_DIR)]))
    sys.modules[PACKAGE] = package
    try:
        package.__spec__.loader.exec_module(package)
        for name in added:
            del sys.modules[name]
        added.clear()
        yield package.default_compute_score
    finally:
        for name in added + [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]


# ---------------------------------------------------------------------- GSM8K cases

# (the number as the response writes it, the dataset's ground truth)
GSM8K_ANSWERS = [
    ("72", "72"), ("0", "0"), ("-7", "-7"), ("1,000", "1000"), ("1,234,567", "1234567"),
    ("3.5", "3.5"), ("3.50", "3.5"), (".5", "0.5"), ("-0.25", "-0.25"), ("10.", "10"),
    ("7", "-7"),
]
GSM8K_PHRASINGS = [
    "#### {w}",
    "####{w}",
    "####  {w}",
    "##### {w}",
    "#### ${w}",
    "#### -{w}",
    "#### {w}.",
    "#### {w} dollars",
    "#### {w}\n#### 99",
    "#### 99\n#### {w}",
    "{w}",
    "The answer is {w}.",
    "The answer is {w}, so we are done",
    "So she pays ${w} in total.",
    "She has {w} apples and gives 3 away.",
    "Step 1: 3 + 4 = 7.\nStep 2: 7 * 6 = 42.\nSo the total is {w}.\n#### {w}",
    "Natalia sold 48/2 = 24 clips in May.\n#### {w}\n",
    "x" * 400 + "\n#### {w}",
    "#### {w}\n" + "and that is all " * 30,
    "#### {w}" + "." * 290,
    "#### {w}" + " " * 296,
    "The {w} was {w}, total 1,000.5.",
    "{w} = {w}. \\boxed{{{w}}}",
]
GSM8K_EXTRA = [
    "", ".", "...", "-", "--5", "-.5", "Hello, world!", "#### ", "####", "#### .", "#### ,",
    "#### -", "1.2.3", "#### 1.2.3", "٤٢", "#### ٤٢", "#### 4 2", "#### 4\u00a02", "1e5", "#### 1e5",
    "#### 72\n#### ", "72#### 5", "####\t72", "0" * 1000, "9" * 301, "#### " + "1" * 400,
    "A" * 10_000 + "#### 72", "#### 72" + "B" * 10_000, "#### 7,2", "#### ,72", "#### 72,",
]
GSM8K_TRUTHS = ["72", "-7", "1000", "0.5", ".", ",", "", "1.2.3"]


def _gsm8k_cases() -> list[tuple[str, str]]:
    cases = []
    for written, truth in GSM8K_ANSWERS:
        for phrasing in GSM8K_PHRASINGS:
            text = phrasing.format(w=written)
            cases += [(text, truth), (text, written)]
    cases += [(text, truth) for text in GSM8K_EXTRA for truth in GSM8K_TRUTHS]
    return cases


GSM8K_CASES = _gsm8k_cases()


# ---------------------------------------------------------------------- MATH cases

# (what the response puts in its box, the dataset's ground truth)
MATH_ANSWERS = [
    ("5", "5"), ("5", "6"), ("-5", "-5"), ("1,000", "1000"), ("1,000", "1,000"),
    ("\\frac12", "\\frac{1}{2}"), ("\\frac{1}{2}", "\\frac{1}{2}"), ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\tfrac{1}{2}", "\\frac12"), ("0.5", "\\frac{1}{2}"), ("0.5", "0.5"), ("1/2", "\\frac{1}{2}"),
    ("-3/4", "\\frac{-3}{4}"), ("-3/4", "-\\frac{3}{4}"), ("3/-4", "\\frac{3}{-4}"), ("03/4", "\\frac{3}{4}"),
    ("+3/4", "\\frac{3}{4}"), ("\\frac1{72}", "\\frac{1}{72}"), ("\\frac{72}1", "\\frac{72}{1}"),
    ("\\frac{\\frac{1}{2}}{3}", "\\frac{\\frac12}{3}"), ("\\frac1", "\\frac1"), ("\\frac", "\\frac"),
    ("5 \\text{ cm}", "5"), ("5\\text{cm}", "5"), ("5 \\text{ cm} + 2 \\text{ m}", "5"),
    ("5 \\text{ cm} + 2 \\text{ m}", "5 \\text{ cm} + 2 \\text{ m}"), ("5 dollars", "5"),
    ("\\left( 1, 2 \\right)", "(1,2)"), ("[1, 2)", "[1,2)"), ("(-\\infty, 3]", "(-\\infty,3]"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("\\begin{pmatrix} 1 \\\\\\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\2\\end{pmatrix}"),
    ("90^\\circ", "90"), ("90^{\\circ}", "90"), ("50\\%", "50"), ("50%", "50"), ("50\\\\%", "50"),
    ("\\$18", "18"), ("$18", "18"), ("x = 5", "5"), ("xy=5", "5"), ("xyz = 5", "5"), ("a=b=5", "5"),
    ("k=3", "k = 3"), ("\\sqrt3", "\\sqrt{3}"), ("2\\sqrt2", "2\\sqrt{2}"), ("\\sqrt", "\\sqrt"),
    ("\\sqrt{}", "\\sqrt{}"), (".5", "0.5"), ("{.5}", "{0.5}"), ("x = .5", "0.5"), ("\\!10", "10"),
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"), ("", ""), ("", "0"), ("\\infty", "\\infty"),
    ("3\\pi", "3 \\pi"), ("\\{1, 2\\}", "\\{1,2\\}"), ("\\text{(A)}", "\\text{(A)}"), ("A", "(A)"),
    ("1\n2", "12"), ("\\left\\{ 1 \\right\\}", "\\{1\\}"), ("a=b=5", "b=5"),
    ("a=b=5", "c=b=5"), ("abc=5", "5"), ("ab=5", "5"), ("\\frac1", ""), ("\\frac{1}{2}+\\frac3", "\\frac{1}{2}+"),
    ("50\\\\\\\\%", "50"),
]
MATH_PHRASINGS = [
    "\\boxed{{{c}}}",
    "The answer is $\\boxed{{{c}}}$.",
    "First I got \\boxed{{7}}, but finally \\boxed{{{c}}}.",
    "\\boxed{{{c}}} but wait, it is \\boxed{{7}}",
    "\\fbox{{{c}}}",
    "\\boxed {{{c}}}",
    "So $\\boxed {c}$ is it.",
    "\\boxed 7 then \\boxed{{{c}}}",
    "\\boxed{{{c}",
    "The answer is {c}.",
    "\\boxed{{{{{c}}}}}",
    "\\boxed\n{{{c}}}",
    "\\boxed}}{{{c}}}",
    "Long reasoning. " * 200 + "\\boxed{{{c}}}",
    "\\(\\boxed{{{c}}}\\)\n\nDone.",
    "\\fbox{{7}} and \\boxed{{{c}}}",
]
MATH_EXTRA = [
    "", "\\boxed", "\\boxed ", "\\boxed{", "\\boxed}", "\\boxed{}", "\\boxed{}}", "\\fbox", "\\fbox{5}",
    "\\boxed{5}}", "}\\boxed{5}", "\\boxed{\\boxed{5}}", "\\boxed{5} \\boxed", "\\boxed 5", "\\boxed 5$ \\boxed 6",
    "\\boxed 5$", "$\\boxed $", "\\boxed{{5}", "\\boxed{5}{6}", "\\boxed5", "\\boxed{5\\}", "\\boxed{\\{5\\}}",
    "\\boxed{" + "{" * 500 + "5" + "}" * 501, "\\boxed{" + "9" * 5000 + "/" + "3" * 5000 + "}",
    "\\boxed{x = \\text{ 1 } \\text{ 2 }}", "\\boxed{\\frac{1}{2}\\frac}", "\\boxed{\\sqrt}",
]
MATH_TRUTHS = ["5", "", "\\frac{1}{2}", "\\sqrt", "{5}", "6", "{5}{6}"]


def _math_cases() -> list[tuple[str, str]]:
    cases = []
    for content, truth in MATH_ANSWERS:
        for phrasing in MATH_PHRASINGS:
            text = phrasing.format(c=content)
            cases += [(text, truth), (text, content)]
    cases += [(text, truth) for text in MATH_EXTRA for truth in MATH_TRUTHS]
    return cases


MATH_CASES = _math_cases()


def _fuzz_cases(n: int, pieces: list[str], truths: list[str], seed: int) -> list[tuple[str, str]]:
    """`n` strings of 1 to 12 random `pieces`, each with a random truth (seeded)."""
    rng = random.Random(seed)
    return [("".join(rng.choices(pieces, k=rng.randint(1, 12))), rng.choice(truths)) for _ in range(n)]


GSM8K_PIECES = ["#### ", "####", "#", " ", "-", ".", ",", "$", "1", "2", "72", "\n", "x", "1,000", "0.5", "a"]
MATH_PIECES = ["\\boxed{", "\\boxed ", "\\boxed", "\\fbox{", "{", "}", "$", " ", "1", "2", "5", ".", "/", "-",
               "=", "x", "\\frac", "\\dfrac", "\\sqrt", "\\text{ ", "\\left(", "\\right)", "^\\circ", "\\%",
               "\\\\", "\\!", "\n", "0.5", "\\$"]
GSM8K_FUZZ = _fuzz_cases(1500, GSM8K_PIECES, GSM8K_TRUTHS + ["1", "2", "12"], seed=0)
MATH_FUZZ = _fuzz_cases(3000, MATH_PIECES, MATH_TRUTHS + ["1", "2", "\\frac{1}{2}", "12", "x"], seed=1)


def _mismatches(ours, theirs, cases) -> list[tuple[str, str, float, float]]:
    found = []
    for text, truth in cases:
        mine, ref = ours(text, truth), float(theirs(text, truth))
        if type(mine) is not float or mine != ref:
            found.append((text[:200], truth, mine, ref))
    return found


def test_case_tables_are_large_and_both_outcomes_occur():
    assert len(GSM8K_CASES) >= 300 and len(MATH_CASES) >= 1000
    for cases, fn in ((GSM8K_CASES, gsm8k_score), (MATH_CASES, math_score)):
        assert {fn(text, truth) for text, truth in cases} == {0.0, 1.0}
    assert sum(math_score(t, g) for t, g in MATH_FUZZ) > 10  # the fuzz reaches matches too


@pytest.mark.parametrize("flexible", [False, True], ids=["strict", "flexible"])
def test_gsm8k_equals_verl(flexible):
    method = "flexible" if flexible else "strict"
    bad = _mismatches(lambda t, g: gsm8k_score(t, g, flexible=flexible),
                      lambda t, g: verl_gsm8k.compute_score(t, g, method=method), GSM8K_CASES + GSM8K_FUZZ)
    assert not bad, f"{len(bad)} differ from verl, e.g. {bad[:5]}"


def test_math_equals_verl(capsys):
    bad = _mismatches(math_score, verl_math.compute_score, MATH_CASES + MATH_FUZZ)
    capsys.readouterr()  # verl prints the exceptions it swallows
    assert not bad, f"{len(bad)} differ from verl, e.g. {bad[:5]}"


def test_known_behaviour():
    """A few of verl's rules spelled out (the tables above check them against verl)."""
    assert gsm8k_score("so 1,000 in all\n#### 1,000", "1000") == 1.0
    assert gsm8k_score("#### 1,000", "1000", flexible=True) == 0.0  # flexible keeps commas
    assert gsm8k_score("#### -7", "-7") == 1.0 and gsm8k_score("####-7", "-7") == 0.0
    assert gsm8k_score("#### 72" + "x" * 300, "72") == 0.0  # past the last 300 characters
    assert gsm8k_score("#### 72.", "72") == 0.0  # the trailing dot is part of the number
    assert math_score("so $\\boxed{\\dfrac12}$", "\\frac{1}{2}") == 1.0
    assert math_score("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert math_score("\\boxed{1} \\boxed{2}", "2") == 1.0
    assert math_score("\\fbox{2}", "2") == 0.0
    assert math_score("\\boxed 2$ or \\boxed{3}", "2") == 1.0  # the space form wins
    assert math_score("\\boxed{x = 90^\\circ}", "90") == 1.0


def test_odd_inputs_equal_verl(capsys):
    for text, truth in [(None, "5"), (5, "5"), (b"\\boxed{5}", "5"), (["\\boxed{5}"], "5"),
                        ("\\boxed{5}", None), ("\\boxed{5}", 5), ("\\boxed{\\sqrt}", 5)]:
        assert math_score(text, truth) == float(verl_math.compute_score(text, truth)) == 0.0
    for flexible, method in ((False, "strict"), (True, "flexible")):
        assert gsm8k_score("#### 5", None, flexible) == float(verl_gsm8k.compute_score("#### 5", None, method))
        assert gsm8k_score("#### 5", 5, flexible) == float(verl_gsm8k.compute_score("#### 5", 5, method)) == 0.0
        for text in (None, 5, b"#### 5"):  # verl does not catch these: neither do we
            with pytest.raises(TypeError):
                verl_gsm8k.compute_score(text, "5", method=method)
            with pytest.raises(TypeError):
                gsm8k_score(text, "5", flexible)
    capsys.readouterr()


def test_scorers_take_prompt_response_truth():
    assert set(SCORERS) == {"gsm8k", "gsm8k_flexible", "math"}
    for text, truth in GSM8K_CASES[:60]:
        assert SCORERS["gsm8k"]("ignored", text, truth) == gsm8k_score(text, truth)
        assert SCORERS["gsm8k_flexible"]("ignored", text, truth) == gsm8k_score(text, truth, flexible=True)
    for text, truth in MATH_CASES[:60]:
        assert SCORERS["math"]("ignored", text, truth) == math_score(text, truth)
    assert pickle.loads(pickle.dumps(SCORERS["math"])) is SCORERS["math"]


def _verl_branches(init: Path) -> dict[str, str]:
    """The data sources of ``default_compute_score``'s branches that call the gsm8k or
    math_reward module -> that module, read from the source (no branch is executed)."""
    tree = ast.parse(init.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "default_compute_score")
    found: dict[str, str] = {}
    branch = next(n for n in fn.body if isinstance(n, ast.If))
    while isinstance(branch, ast.If):
        modules = {a.name for n in branch.body if isinstance(n, ast.ImportFrom) for a in n.names}
        sources = [c.value for c in ast.walk(branch.test) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        for module in modules & {"gsm8k", "math_reward"}:
            found.update(dict.fromkeys(sources, module))
        branch = branch.orelse[0] if len(branch.orelse) == 1 else None
    return found


def test_source_list_is_verls():
    assert _verl_branches(REWARD_DIR / "__init__.py") == {
        source: {"gsm8k": "gsm8k", "math": "math_reward"}[name] for source, name in SOURCE_SCORERS.items()}


def test_score_by_source_routes_like_verl(verl_default_compute_score, capsys):
    samples = [("#### 72", "72"), ("The answer is 72.", "72"), ("#### 1,000", "1000"), ("\\boxed{72}", "72"),
               ("$\\boxed{\\dfrac12}$", "\\frac{1}{2}"), ("\\boxed{0.5}", "\\frac{1}{2}"), ("", "")]
    for source in SOURCE_SCORERS:
        for text, truth in samples:
            expected = verl_default_compute_score(source, text, truth, extra_info={"split": "test"})
            assert score_by_source(source, text, truth, extra_info={"split": "test"}) == expected, (source, text)
    capsys.readouterr()


def test_unknown_source_says_what_to_do():
    with pytest.raises(UnknownDataSource) as info:
        score_by_source("openai/gsm8K", "#### 72", "72")
    message = str(info.value)
    assert "\n" not in message and "'openai/gsm8K'" in message
    assert message.index("openai/gsm8k") < min(message.index(s) for s in SOURCE_SCORERS if s != "openai/gsm8k")
    assert "rl.reward.function" in message and "builtin:gsm8k" in message and "builtin:math" in message
    assert isinstance(info.value, ValueError) and info.value.data_source == "openai/gsm8K"
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is UnknownDataSource and str(again) == message
    for source in ("math_dapo", "aime2024", "", "OPENAI/GSM8K", None, ["openai/gsm8k"], "multi\nline"):
        with pytest.raises(UnknownDataSource) as info:
            score_by_source(source, "#### 72", "72")
        assert "\n" not in str(info.value)
