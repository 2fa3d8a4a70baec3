"""Every notebook under notebooks/ runs top to bottom under nbclient: in the small mode (PPO_MAX_MODE=small, the tiny
world), except RECORDS_NOTEBOOKS, which run in records mode (the committed notebooks' mode: the registry's panels from
the committed records, the panels a record cannot draw retrained in the tiny world, PPO_MAX_RETRAIN=small) and run
twice: the second time must train nothing for the registry's panels and write the same PNGs, byte for byte.

Run alone: `python -m pytest -m notebook`. The notebooks are executed in memory, their PNGs written to a temporary
folder (PPO_MAX_FIGURES): their committed outputs and figures are never overwritten by the test. They start as soon
as the tests are collected (start_early, called by conftest.py), on a thread of this process, and each notebook's test
reads its result.
"""
import os
import queue
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from conftest import BACKGROUND


ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def kernel_dirs(root: Path) -> list[str]:
    """A private 'python3' kernelspec under `root` that launches this very interpreter (sys.executable).

    A fresh `pip install -r requirements.txt` ships a 'python3' spec with ipykernel, but a user-level spec of
    the same name (~/.local/share/jupyter/kernels) may point at another Python without torch; writing our
    own into a temporary folder sidesteps both, and installs nothing into the environment.
    """
    write_kernel_spec(root / "python3")  # argv = [sys.executable, "-m", "ipykernel_launcher", ...]
    return [str(root)]


# the notebooks executed in records mode, and the PNGs of their panels of a registry's runs (drawn from the records)
RECORDS_NOTEBOOKS = {"vanilla_collapse": ("vanilla_collapse_fig4.png", "vanilla_collapse_fig4_gold.png"),
                     "methods": ("methods_tricks.png",), "worlds": ("worlds_fig4.png",)}
# a last cell for those: the (name, seed) of every run the kernel's runner trained, as one JSON line
TRAINED_CELL = 'import json as _json, runs as _runs; print("TRAINED " + _json.dumps(_runs.TRAINED["names"]))'


def env_for(path: Path, env: dict, figures: Path) -> dict:
    """The kernel's environment for one notebook: small mode, or records mode (RECORDS_NOTEBOOKS) with its panels that
    need samples or a model retrained in the tiny world; PNGs into `figures`."""
    mode = {"PPO_MAX_MODE": "records", "PPO_MAX_RETRAIN": "small"} if path.stem in RECORDS_NOTEBOOKS else \
        {"PPO_MAX_MODE": "small"}
    return {**env, **mode, "PPO_MAX_FIGURES": str(figures)}


def execute(path: Path, kernel_dirs: list[str], env: dict, running: set):
    """One notebook top to bottom in a kernel of its own (environment `env`), in memory; raises CellExecutionError,
    naming the cell, on the first failing cell. Its kernel manager is in `running` while it runs. A notebook of
    RECORDS_NOTEBOOKS ends with TRAINED_CELL. Returns the executed notebook."""
    nb = nbformat.read(path, as_version=4)
    if path.stem in RECORDS_NOTEBOOKS:
        nb.cells.append(nbformat.v4.new_code_cell(TRAINED_CELL))
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=kernel_dirs))
    assert Path(km.kernel_spec.argv[0]) == Path(sys.executable)
    running.add(km)
    try:
        # cleanup_kc: shut the kernel down at the end, pass or fail. nbclient does that by default only for a kernel
        # manager of its own; given ours, it left every notebook's kernel running (with torch loaded) to the end
        NotebookClient(nb, km=km, timeout=900, resources={"metadata": {"path": str(path.parent)}}).execute(
            cleanup_kc=True, env=env)
    finally:
        running.discard(km)
    return nb


TIMES: dict = {}  # notebook → (start, end) in seconds after the tests were collected (early_summary)
EXECUTED: dict = {}  # notebook → the executed notebook (nbformat), for the records-mode checks
EARLY: dict = {}  # what start_early began: "futures" (name → Future of None or the exception), "stop", "running"


def start_early(session) -> None:
    """Called by conftest.py once the tests are collected: the selected notebooks start on a thread of their own as
    soon as the background runs (@pytest.mark.background) are done, one at a time with one training slot
    (PPO_MAX_JOBS=1), so that they take the core the rest of the suite, one test at a time, leaves free; when nothing
    but this module was selected, two at a time on both cores (each kernel trains on one core, --threads 1;
    notebooks/runs.py's locks let two share the cached bases and runs). The notebooks' tests come last (conftest.py
    sorts them there); when the first of them runs, the other core is free too, and finish_on_both lets the
    notebooks not yet started run two at a time."""
    chosen = {item.callspec.params["path"] for item in session.items
              if getattr(item, "originalname", None) == "test_notebook_runs_top_to_bottom"}
    chosen |= {ROOT / "notebooks" / f"{item.callspec.params['name']}.ipynb" for item in session.items
               if (getattr(item, "originalname", None) or "").startswith("test_records_mode_trains_nothing")}
    paths = [p for p in NOTEBOOKS if p in chosen]
    if not paths:
        return
    alone = all(getattr(item, "module", None) is sys.modules[__name__] for item in session.items)
    jobs = 2 if alone else 1
    root = Path(tempfile.mkdtemp(prefix="ppo-max-kernels-"))
    env = {**os.environ, "PPO_MAX_JOBS": str(jobs)}  # the kernels' slots (env_for adds each notebook's mode)
    env.pop("PPO_MAX_FULL", None)
    stop, running, dirs = threading.Event(), set(), kernel_dirs(root)

    t0, times = time.time(), TIMES

    def run(path):
        if stop.is_set():
            return RuntimeError("the session ended before this notebook ran")
        start = time.time() - t0
        try:
            EXECUTED[path.stem] = execute(path, dirs, env_for(path, env, root / "figures-1"), running)
        except Exception as e:  # noqa: BLE001 — reported by that notebook's own test
            return e
        finally:
            times[path.stem] = (start, time.time() - t0)
        return None

    futures, todo = {p.stem: Future() for p in paths}, queue.SimpleQueue()
    for p in paths:
        todo.put(p)

    # conftest's background runs (already started) go first: the notebooks take the spare core after them, so that
    # the tests that run one at a time never share their core with two other trainings
    background = [item.stash[BACKGROUND][1] for item in session.items if BACKGROUND in item.stash]

    def worker():  # a daemon thread: one stuck on a dead kernel cannot hold the interpreter open at exit
        for proc in background:
            proc.wait()
        while True:
            try:
                path = todo.get_nowait()
            except queue.Empty:
                return
            futures[path.stem].set_result(run(path))

    for i in range(jobs):
        threading.Thread(target=worker, name=f"notebooks-{i}", daemon=True).start()
    EARLY.update(futures=futures, stop=stop, running=running, root=root, env=env, jobs=jobs, worker=worker)


def early_summary() -> str | None:
    """A line for the end of the session: when the notebooks ran (so that a slow suite shows which core waited)."""
    times = dict(TIMES)
    if not times:
        return None
    first, last = min(a for a, _ in times.values()), max(b for _, b in times.values())
    slowest = max(times, key=lambda k: times[k][1] - times[k][0])
    return (f"notebooks: {len(times)} ran from {first:.0f} s to {last:.0f} s after collection "
            f"({sum(b - a for a, b in times.values()):.0f} s of kernels; the longest {slowest}, "
            f"{times[slowest][1] - times[slowest][0]:.0f} s)")


def finish_on_both() -> None:
    """Once the rest of the suite is done: the notebooks not yet started run two at a time, each kernel from now on
    with two training slots (a kernel already running keeps its one: at most two trainings at once, one per core)."""
    if EARLY.get("jobs") != 1:
        return
    EARLY["jobs"] = 2
    EARLY["env"]["PPO_MAX_JOBS"] = "2"   # read by execute() when it starts the next kernel
    threading.Thread(target=EARLY["worker"], name="notebooks-1", daemon=True).start()


def stop_early() -> None:
    """Called by conftest.py at the session's end: notebooks not yet started never start, running kernels stop."""
    if not EARLY:
        return
    import signal
    EARLY["stop"].set()
    for km in list(EARLY["running"]):  # killed, not shut down: the thread that runs it is inside nbclient's own calls
        process = getattr(getattr(km, "provisioner", None), "process", None)
        if process is not None and process.poll() is None:
            try:  # the kernel leads a process group of its own: its runner's workers go with it
                if os.getpgid(process.pid) == process.pid:
                    os.killpg(process.pid, signal.SIGKILL)
                else:
                    process.kill()
            except ProcessLookupError:
                pass
    import shutil
    shutil.rmtree(EARLY["root"], ignore_errors=True)
    EARLY.clear()


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path):
    finish_on_both()   # the notebooks' tests come last: the rest of the suite is done, both cores are free
    error = EARLY["futures"][path.stem].result()   # None, or the exception of the first failing cell
    if error is not None:
        raise error


def trained_runs(nb) -> list[tuple[str, int]]:
    """The (name, seed) of every run the kernel trained, from TRAINED_CELL's output."""
    import json
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    return [tuple(x) for x in json.loads(text.split("TRAINED ", 1)[1])]


@pytest.mark.notebook
@pytest.mark.parametrize("name", sorted(RECORDS_NOTEBOOKS))
def test_records_mode_trains_nothing_for_the_registry_panels_and_draws_them_alike_twice(name):
    """In records mode a notebook's panels of a registry's runs come from the committed records: the runs it trains
    are only those of its panels that need samples or a model (claims.retrained) and of its own comparison, none of
    the registry's variants it draws from records; executed a second time (its retrained runs now cached) it trains
    nothing, and the registry panels' PNGs are the same bytes as the first time."""
    finish_on_both()
    error = EARLY["futures"][name].result()
    if error is not None:
        pytest.skip(f"{name} failed to run (its own test reports it)")
    path = ROOT / "notebooks" / f"{name}.ipynb"
    first = EXECUTED[name]
    code = "\n".join(c.source for c in first.cells if c.cell_type == "code")
    drawn = [o.get("text", "") for c in first.cells if c.cell_type == "code" and "claims.runs_for(" in c.source
             for o in c.outputs]
    assert any("[records] drawn from v2's committed records, nothing trained for them" in t for t in drawn)
    # the runs trained: only those a retrained panel (claims.retrained) or the notebook's own comparison asks for
    import re
    retrained = {v for call in re.findall(r"claims\.retrained\(([^)]*)\)", code)
                 for v in re.findall(r'"([\w.-]+)"', call)}
    own = set(re.findall(r'\("([\w.-]+)", \(', code)) if name == "methods" else set()
    trained = {n for n, _ in trained_runs(first)}
    assert trained <= retrained | own, f"{name} trained {sorted(trained - retrained - own)} for a registry panel"
    env = env_for(path, EARLY["env"], EARLY["root"] / "figures-2")
    second = execute(path, kernel_dirs(EARLY["root"] / f"kernels-{name}"), env, EARLY["running"])
    assert trained_runs(second) == []
    for png in RECORDS_NOTEBOOKS[name]:
        a, b = (EARLY["root"] / d / png for d in ("figures-1", "figures-2"))
        assert a.read_bytes() == b.read_bytes(), f"{png} differs between two executions"


# ---------------------------------------------------------------------------------------------------------------
# The figure notebooks and the claims registry (notebooks/claims.py): fast checks, no notebook is executed
# ---------------------------------------------------------------------------------------------------------------
sys.path.insert(0, str(ROOT / "notebooks"))
import claims  # noqa: E402

FIGURE_NOTEBOOKS = sorted({c.notebook for c in claims.R.claims})   # the selected registry's (v2 by default)
OLD_RULE = ("runs.verdict", "runs.claim", "runs.tally", "runs.RULE", "runs.MARGINS")
OWN_RUNS = ("runs.run(", "runs.run_seeds", "runs.run_many", "runs.evaluate_checkpoints")
# a notebook whose comparison of its own (its own runs and interval rule) comes before the registry's claims: the
# heading from which on its cells follow the figure notebooks' rules (methods.ipynb compares methods the registry
# does not name; registry v2's claims on the newer tricks follow it)
OWN_SECTION_ENDS = {"methods": "## Registry v2's claims"}


def cells(name: str) -> list:
    return nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4).cells


@pytest.mark.parametrize("name", FIGURE_NOTEBOOKS)
def test_figure_notebook_shows_its_claims_as_the_registry_computes_them(name):
    """Every verdict a figure notebook prints comes from claims.py: its verdict cell shows every claim whose
    Claim.notebook is this notebook, it ends with "What holds here" printing claims.holds, and no cell applies the
    runner's older rule or trains a run that is not a registry variant (every run goes through claims.runs_for);
    a notebook of OWN_SECTION_ENDS is held to that from its registry section on (its own comparison comes first)."""
    nb = cells(name)
    if name in OWN_SECTION_ENDS:
        start = [i for i, c in enumerate(nb) if c.cell_type == "markdown" and c.source.startswith(OWN_SECTION_ENDS[name])]
        assert len(start) == 1, f"{name}: no single cell starts with {OWN_SECTION_ENDS[name]!r}"
        nb = nb[start[0]:]
    code = "\n".join(c.source for c in nb if c.cell_type == "code")
    assert f'claims.show_notebook("{name}")' in code
    assert nb[-2].cell_type == "markdown" and nb[-2].source.startswith("## What holds here")
    assert nb[-1].cell_type == "code" and nb[-1].source.strip() == f'claims.holds("{name}")'
    assert "claims.runs_for(" in code
    assert not [w for w in OLD_RULE + OWN_RUNS if w in code], f"{name}: {[w for w in OLD_RULE + OWN_RUNS if w in code]}"


def test_no_notebook_or_notebook_module_keeps_a_results_placeholder():
    placeholders = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        placeholders += [f"{path.name} cell {i}" for i, c in enumerate(cells(path.stem))
                         if any(line.strip() == "RESULTS" for line in c.source.splitlines())]
    for path in sorted((ROOT / "notebooks").glob("*.py")):
        placeholders += [f"{path.name}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                         if line.strip().strip("#").strip() == "RESULTS"]
    assert not placeholders


def base_records(seeds, after20: float = 0.0) -> dict:
    """Records of the bases of `seeds` whose metrics make rm.ipynb's claims known: fig3 and fig2 as the paper
    (shares well above ½; accuracy flat after 20 % unless `after20`), sec4.3 undecided (the RM's slope − gold's:
    +1 / −1 by seed)."""
    return {(claims.BASE, s): {"metrics": {"rm_share20": 0.9 + 0.01 * (s % 2), "rm_after20": after20 + 0.001 * (s % 3),
                                           "margin_pos": 0.8 + 0.01 * (s % 2), "rm_gold_agree": 0.7 + 0.01 * (s % 3),
                                           "length_bias": 1.0 if s % 2 else -1.0}} for s in seeds}


def test_holds_prints_every_claim_of_a_notebook_with_the_answer_its_records_give(capsys, monkeypatch):
    monkeypatch.setattr(claims._Selected, "registry", claims.registry("v1"))   # v1's claims of rm.ipynb, on v1's seeds
    claims.holds("rm", base_records(claims.SEEDS))
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")] == ["fig3", "fig2", "sec4.3"]
    answers = [line.strip() for line in out.splitlines() if line.strip().startswith("→")]
    assert answers == ["→ supported", "→ supported", "→ undecided"]
    assert "undecided: RM − gold score change per filler token" in out
    # fig3's first part holds and its second does not (accuracy still rising after 20 %): the claim is against
    claims.holds("rm", base_records(claims.SEEDS, after20=0.1))
    assert capsys.readouterr().out.splitlines()[1].strip() == "→ contradicted (a difference where none was claimed)"
    claims.holds("rm", base_records(claims.SEEDS[:-1]))                  # the last planned seed has no record
    out = capsys.readouterr().out
    assert out.count("→ not run") == 3 and f"seeds without a record yet: [{claims.SEEDS[-1]}]" in out


def test_heldout_curve_is_the_curve_the_registry_reads(tmp_path):
    """claims.heldout_curve (what the figures draw) against claims.METRICS' hgold_* (what the verdicts read) on one
    run: the held-out points, then the final evaluation, each minus the step-0 point."""
    import json
    gold = {0: 2.0, 8: 2.5, 16: 1.0}
    rows = [{"step": s, **({"heldout/gold": gold[s]} if s in gold else {})} for s in range(20)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"steps": 20, "final": {"gold_reward": 0.5}, "dir": tmp_path}
    steps, g = claims.heldout_curve(summary)
    assert steps.tolist() == [0, 8, 16, 20] and g.tolist() == [0.0, 0.5, -1.0, -1.5]
    run = {"metrics": rows, "summary": summary}
    assert g[1:].mean() == pytest.approx(claims.METRICS["hgold_auc"](run))
    assert g[-3:].mean() == pytest.approx(claims.METRICS["hgold_end"](run))


@pytest.fixture
def full_budget(monkeypatch):
    """runs.FULL for one test; config_key, which depends on the budget, cached afresh before and after."""
    import runs
    claims._config_key.cache_clear()
    monkeypatch.setattr(runs, "FULL", True)
    monkeypatch.setattr(runs, "MODE", "full")
    yield runs
    claims._config_key.cache_clear()


def test_runs_for_reads_the_run_the_registry_trained_under_another_name_of_the_same_config(full_budget, monkeypatch):
    """Two variants of one config share one run, trained by --run under the first name: a figure asking for the
    other reads that run rather than training its own (the full notebooks only read what the campaign cached)."""
    runs = full_budget
    monkeypatch.setitem(claims.R.variants, "twin-b", ("--kl-coef", "0.07"))
    monkeypatch.setitem(claims.R.variants, "twin-a", ("--kl-coef", "0.070"))   # the same config, the first name
    assert claims.config_key("twin-a", 6) == claims.config_key("twin-b", 6) != claims.config_key("ppo-max", 6)
    asked = []   # the names runs_for hands to run_many (which reads a cached run or trains it)
    monkeypatch.setattr(runs, "run_many", lambda specs: [asked.append(s[0]) or {"name": s[0]} for s in specs])
    cache = {"twin-a"}
    monkeypatch.setattr(runs, "cached", lambda name, *_: {"name": name} if name in cache else None)
    got = claims.runs_for(["twin-b", "ppo-max", "twin-a"], seeds=(6,))
    assert asked == ["twin-a", "ppo-max"]
    assert got["twin-b"] == got["twin-a"] == [{"name": "twin-a"}]
    asked.clear()
    cache = {"twin-b"}                        # a run cached under the second name is read, not trained again
    monkeypatch.setattr(runs, "cached", lambda name, *_: {"name": name} if name in cache else None)
    claims.runs_for(["twin-a"], seeds=(6,))
    assert asked == ["twin-b"]


def test_the_mode_comes_from_one_switch_and_a_bad_one_is_a_one_line_error(capsys):
    import runs
    assert runs.mode_from({}) == "records" and runs.mode_from({"PPO_MAX_FULL": "1"}) == "full"
    assert runs.mode_from({"PPO_MAX_MODE": "small", "PPO_MAX_FULL": "1"}) == "small"
    assert runs.full_from("records", {}) and not runs.full_from("records", {"PPO_MAX_RETRAIN": "small"})
    assert runs.full_from("full", {}) and not runs.full_from("small", {})
    with pytest.raises(SystemExit) as e:
        runs.mode_from({"PPO_MAX_MODE": "fast"})
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: PPO_MAX_MODE='fast'")


def test_records_mode_draws_every_seed_the_claims_judge_and_reads_what_the_verdicts_read(monkeypatch, capsys):
    """runs_for in records mode trains nothing (the runner is never asked) and returns, per variant, the records of
    every seed that the notebook's claims reading it judge; a record's run gives back the numbers its metrics hold:
    the held-out curve as hgold_* read it, the final gold and win − lose, the per-step curve."""
    import runs
    monkeypatch.setattr(runs, "MODE", "records")
    monkeypatch.setattr(runs, "run_many", lambda specs: pytest.fail(f"records mode trained {specs}"))
    got = claims.runs_for(["vanilla", "vanilla-cliphigher"], notebook="methods")
    assert "nothing trained for them" in capsys.readouterr().out
    judged = {s for c in claims.R.claims if c.notebook == "methods"
              if "vanilla-cliphigher" in {v for p in c.parts for v in claims.part_variants(p)} for s in c.seeds}
    assert [r["seed"] for r in got["vanilla-cliphigher"]] == sorted(judged) and len(judged) > len(claims.R.plot_seeds)
    recs = claims.records()
    for r in got["vanilla"]:
        m = recs[("vanilla", r["seed"])]["metrics"]
        steps, g = claims.heldout_curve(r)
        assert g[1:].mean() == pytest.approx(m["hgold_auc"]) and g[-3:].mean() == pytest.approx(m["hgold_end"])
        assert runs.held_out([r])[0] == pytest.approx(m["win_lose"]) and r["final"]["gold_reward"] == m["final_gold"]
        assert runs.series([r], "policy/entropy")[0, -10:].mean() == pytest.approx(m["last10:policy/entropy"])
    with pytest.raises(ValueError, match="keeps no samples"):
        runs.samples(got["vanilla"][0])
