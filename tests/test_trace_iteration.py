"""tools/trace_iteration.py's counting rules on a small hand-labelled file: which lines of a function count, and
how each is classified (the share the README quotes rests on them)."""
import textwrap

import trace_iteration as T

SOURCE = textwrap.dedent('''
    def shape(scores, mask, kl_coef):
        """A docstring: not counted."""
        # a comment: not counted
        if scores.dim() != 1:
            raise ValueError("scores must be (B,)")

        def inner(x):  # counted only when entered, as its own function
            return x
        rewards = -kl_coef * mask
        stats = {"kl": float(kl_coef),
                 "n": 2}
        return rewards + inner(scores)


    def check_inputs(x):
        return x
''')


def test_function_lines_leave_out_docstring_blanks_comments_and_inner_functions(tmp_path):
    (tmp_path / "mod.py").write_text(SOURCE)
    src = T.Source(tmp_path / "mod.py")
    lines = [src.text[ln - 1].strip() for ln in T.function_lines(src, "shape")]
    assert lines == ["def shape(scores, mask, kl_coef):", "if scores.dim() != 1:",
                     'raise ValueError("scores must be (B,)")', "rewards = -kl_coef * mask",
                     'stats = {"kl": float(kl_coef),', '"n": 2}', "return rewards + inner(scores)"]
    inner = [src.text[ln - 1].strip() for ln in T.function_lines(src, "shape.inner")]
    assert inner == ["def inner(x):  # counted only when entered, as its own function", "return x"]


def test_classify_validation_stats_and_algorithm(tmp_path):
    (tmp_path / "mod.py").write_text(SOURCE)
    src, sources = T.Source(tmp_path / "mod.py"), {}
    kind = {src.text[ln - 1].strip(): T.classify(tmp_path, sources, "mod.py", ln)
            for q in ("shape", "check_inputs") for ln in T.function_lines(src, q)}
    assert kind["if scores.dim() != 1:"] == kind['raise ValueError("scores must be (B,)")'] == "validation"
    assert kind['stats = {"kl": float(kl_coef),'] == kind['"n": 2}'] == "stats"
    assert kind["rewards = -kl_coef * mask"] == kind["return rewards + inner(scores)"] == "algorithm"
    assert kind["def check_inputs(x):"] == kind["return x"] == "validation"  # a check_* function is validation whole


def test_classify_by_file(tmp_path):
    """monitor.py is logging and the alarm, toy_world.py the judge, checkpoint.py its own kind, whatever the line."""
    for name, want in (("monitor.py", "logging and the alarm"), ("toy_world.py", "the judge"),
                       ("checkpoint.py", "checkpoints, signals, the guard")):
        (tmp_path / name).write_text(SOURCE)
        assert T.classify(tmp_path, {}, name, 10) == want
