"""Break each behaviour on purpose, run the test that claims it, expect a failure.

    python tests/break_on_purpose.py [WORD ...]

Each entry below is one deliberate break of dpnb (a changed constant, a
skipped call, a removed branch) and the tests that must fail because of it
-- the proof that those tests are not vacuous (tests/README.md).  The file is
changed in place and restored afterwards, even on Ctrl-C; run it on a clean
checkout (it refuses a tree with uncommitted changes to the files it breaks).
With WORDs, only the entries whose name contains one of them run.  Exits 1
if a break was not caught (its tests passed) or could not be applied.
Not part of the pytest run: each entry starts its own pytest, clusters
included (a few minutes in all; the Slurm entry needs the multihost tier's
root and packages).
"""

from __future__ import annotations

import subprocess
import sys
import time

ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))

#: (what the tests claim, file, text to change, the broken text, the tests)
MUTATIONS = [
 ("the rank table changes in one place", "dpnb/cluster/world.py",
  "    c.adopt_ranks(ranks, fresh=added, new_world=True)\n",
  "    c.ranks[:] = ranks\n    c.adopt_ranks(ranks, fresh=added, new_world=True)\n",
  ["tests/unit/test_layers.py::test_the_rank_table_changes_in_one_place"]),
 ("launchers are asked, not named", "dpnb/cluster/__init__.py",
  "        self.engine_launcher.kill(self, self.ranks[r])\n",
  "        if self.launcher == \"local\":\n            self.procs.kill_local(self.ranks[r])\n"
  "        else:\n            self.engine_launcher.kill(self, self.ranks[r])\n",
  ["tests/unit/test_layers.py::test_only_the_launchers_ask_a_launcher_s_name"]),
 ("the runtime knows nothing of training", "dpnb/cluster/keep.py",
  "from ..errors import DpnbError\n", "from ..errors import DpnbError\nfrom ..session import state  # noqa: F401\n",
  ["tests/unit/test_layers.py::test_the_runtime_imports_nothing_above_it"]),
 ("no private runtime attribute from above", "dpnb/magics/cluster_cmds.py",
  "{c.cluster_id}", "{c._ipp.cluster_id}",
  ["tests/unit/test_layers.py::test_no_module_outside_the_runtime_touches_its_private_attributes"]),
 ("kept records keep their keys", "dpnb/session/state.py",
  '"last_wrap": self.last_wrap.to_record()', '"wrap": self.last_wrap.to_record()',
  ["tests/unit/test_session_state.py"]),
 ("outcomes compared with the enum", "dpnb/cluster/waiting.py",
  "if status == Status.TIMEOUT:", 'if status == "timeout":',
  ["tests/unit/test_layers.py::test_rank_outcomes_are_compared_with_the_status_enum"]),
 ("user errors are the listed names", "dpnb/engine/lifecycle.py",
  "class AdoptError(UserError, RuntimeError):", "class AdoptError(RuntimeError):",
  ["tests/unit/test_user_errors.py"]),
 ("dotted engine names resolve", "dpnb/engine/views.py",
  "def straggle_state(", "def straggle_state_gone(",
  ["tests/unit/test_entry_points.py"]),
 ("quiz order fixed across processes", "dpnb/quiz.py",
  'seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")', "seed = hash(key)",
  ["tests/unit/test_quiz.py::test_options_are_shuffled_the_same_way_every_time_and_answers_spread"]),
 ("batch message suggests alternatives", "dpnb/core/batch.py",
  "    if alts:\n        msg +=", "    if False:\n        msg +=",
  ["tests/unit/test_core_batch.py::test_inexact_samples_suggests_exact_alternatives"]),
 ("preload rule engines vs cores", "dpnb/cluster/launchers/local.py",
  'return "all" if n <= cores else "torch"', 'return "all"',
  ["tests/unit/test_cluster_pure.py::test_preload_is_skipped_when_engines_outnumber_cores"]),
 ("cell magic without a cluster says so", "dpnb/magics/cell_cmds.py",
  '        c = self._need()\n        if not code.strip():',
  '        if self.cluster is None:\n            return None\n        c = self._need()\n        if not code.strip():',
  ["tests/unit/test_magic_parsers.py::test_cell_magic_without_cluster_says_start_first"]),
 ("engine meter importable, not skipped", "dpnb/engine/measure.py",
  "def state_bytes(", "def state_bytes_gone(",
  ["tests/unit/test_core_exact_memory.py::test_exact_mode_matches_training_meter"]),
 ("core exact model importable, not skipped", "dpnb/core/exact_memory.py",
  "def exact_rank_bytes(", "def exact_rank_bytes_gone(",
  ["tests/cluster/test_engine_measure.py::test_state_bytes_match_core_exact_model"]),
 ("straggler inject reports what ranks hold", "dpnb/widgets/stragglers.py",
  'C.call_ok(cluster, "dpnb.engine.views.set_straggle", float(delay_ms), ranks=[int(rank)])',
  'C.call_ok(cluster, "dpnb.engine.views.set_straggle", float(delay_ms))',
  ["tests/unit/test_widgets_stragglers.py"]),
 ("a rank stores the delay in seconds", "dpnb/engine/views.py",
  "es.straggle_delay_s = d / 1000.0", "es.straggle_delay_s = d",
  ["tests/unit/test_widgets_stragglers.py::test_a_rank_stores_the_delay_in_seconds"]),
 ("comm hook records its buckets", "dpnb/engine/measure.py",
  "        rec.current_buckets.append(entry)", "        pass",
  ["tests/cluster/test_engine_commhook.py"]),
 ("model views: ring all-reduce cost", "dpnb/core/comm.py",
  'return 2 * (n - 1) if kind == "all_reduce" else n - 1', 'return (n - 1) if kind == "all_reduce" else n - 1',
  ["tests/cluster/test_view_magics.py::test_model_views_need_no_cluster"]),
 ("demo reports disagreeing ranks", "dpnb/demo.py",
  '"dist.all_reduce(t)\\nprint(t.item())", display=False)',
  '"dist.all_reduce(t)\\nprint(t.item() + rank)", display=False)',
  ["tests/cluster/test_demo.py"]),
 ("resize checkpoints in the profile", "dpnb/session/resize.py",
  'checkpoint_dir = tempfile.mkdtemp(prefix="resize-", dir=cluster.profile_dir)',
  'checkpoint_dir = tempfile.mkdtemp(prefix="resize-")',
  ["tests/cluster/test_resize.py::test_resize_2_3_2_trains_on_like_one_process"]),
 ("%dp check compares again", "dpnb/magics/train_cmds.py",
  "        v = self._need().check(a.model)\n", "        return None\n        v = self._need().check(a.model)\n",
  ["tests/cluster/test_training_live.py::test_wrap_data_train_check_via_magics"]),
 ("3 ranks: released, not the group timeout", "dpnb/cluster/waiting.py",
  "        if self.failed_at is not None and now - self.failed_at > FAIL_GRACE_S \\",
  "        if False and self.failed_at is not None and now - self.failed_at > FAIL_GRACE_S \\",
  ["tests/cluster/test_faults3.py"]),
 ("SIGTERM ends an engine at once", "dpnb/engine/process.py",
  "        signal.signal(signal.SIGTERM, signal.SIG_DFL)\n",
  "        import time\n        time.sleep(5)\n        signal.signal(signal.SIGTERM, signal.SIG_DFL)\n",
  ["tests/cluster/test_lifecycle.py::test_sigterm_ends_an_engine_at_once_after_its_atexit_hooks"]),
 ("slurm: both hosts, ranks contiguous per host", "dpnb/cluster/launchers/slurm_mpi.py",
  "    lines = \"\".join(f\"#SBATCH {o.replace('{', '{{').replace('}', '}}')}\\n\" for o in options)",
  "    lines = \"\"",
  ["tests/multihost/test_slurm.py::test_slurm_start_train_restart_stop"]),
 ("displays: every view keeps a text form", "dpnb/display.py",
  '    data = {**data, "text/plain": text}\n', "    data = dict(data)\n",
  ["tests/unit/test_display_text.py"]),
 ("displays: an engine's display updates reach the notebook", "dpnb/engine/setup.py",
  "    process.forward_display_updates()\n", "",
  ["tests/cluster/test_kernel.py::test_magics_preloaded_and_cluster_starts",
   "tests/cluster/test_kernel.py::test_a_display_updated_through_its_handle_updates_live",
   "tests/cluster/test_kernel.py::test_a_short_cells_updated_display_shows_its_last_drawing"]),
 ("displays: an update is applied where its display is", "dpnb/cluster/render.py",
  "        if did is not None and t.get(DISPLAY_UPDATE) and did in at:\n",
  "        if False:\n",
  ["tests/unit/test_engine_displays.py::test_an_update_replaces_its_display_in_place_and_is_not_shown_itself",
   "tests/cluster/test_kernel.py::test_magics_preloaded_and_cluster_starts",
   "tests/cluster/test_kernel.py::test_a_short_cells_updated_display_shows_its_last_drawing"]),
 ("displays: redrawn displays show while the cell runs", "dpnb/cluster/render.py",
  "        if self._kernel:\n            self._show_live_displays()\n", "",
  ["tests/unit/test_engine_displays.py::test_the_streamer_shows_a_redrawn_display_live_and_applies_the_latest_update",
   "tests/cluster/test_kernel.py::test_magics_preloaded_and_cluster_starts",
   "tests/cluster/test_kernel.py::test_a_display_updated_through_its_handle_updates_live"]),
 ("displays: a line still printed runs into nothing (Jupyter)", "dpnb/cluster/render.py",
  '        return {r: "".join(p if not p or p.endswith("\\n") else p + "\\n" for p in parts)\n',
  '        return {r: "".join(parts)\n',
  ["tests/unit/test_streamed_lines.py::test_jupyter_live_area_shows_no_line_run_into_another"]),
 ("displays: the terminal stream prints whole lines once", "dpnb/cluster/render.py",
  "self._streams(whole_lines=not final)", "self._streams(whole_lines=False)",
  ["tests/unit/test_streamed_lines.py::test_terminal_stream_prints_each_line_of_each_rank_whole_and_once"]),
 ("displays: pdb's where starts at the user's code", "dpnb/engine/rankpdb.py",
  "        if first is None or first > i:\n", "        if True:\n",
  ["tests/ecosystem/test_repl_habits.py::test_where_starts_at_the_cell_and_names_it_as_dpnb_does"]),
 ("displays: pdb names a cell as dpnb does", "dpnb/engine/rankpdb.py",
  "        if frames.is_cell(name) and text.startswith(head):\n", "        if False:\n",
  ["tests/ecosystem/test_repl_habits.py::test_where_starts_at_the_cell_and_names_it_as_dpnb_does"]),
 ("displays: the uneven-data note waits for an epoch's end", "dpnb/engine/train_state.py",
  "        if call_steps < (per_rank - pos) // need:  # the call ends before the epoch's last step\n"
  "            return None\n", "",
  ["tests/unit/test_data_note.py"]),
]


def _collects(tests: list[str]) -> str | None:
    """Why the unbroken tree cannot even collect ``tests`` (a missing package, a
    wrong Python), else None: then every break would look caught."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p",
                        "no:cacheprovider", *tests], cwd=ROOT, capture_output=True, text=True)
    if r.returncode == 0:
        return None
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    return "; ".join(lines[-3:])


def main(words: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not words or any(w in m[0] for w in words)]
    why = _collects(sorted({t.split("::")[0] for m in chosen for t in m[4]}))
    if why:
        print(f"NOT RUN  the unbroken tests do not collect with {sys.executable}: {why}")
        return 1
    bad = 0
    for name, f, old, new, tests in chosen:
        path = f"{ROOT}/{f}"
        dirty = subprocess.run(["git", "diff", "--quiet", "--", f], cwd=ROOT).returncode
        with open(path) as fh:
            text = fh.read()
        if dirty or text.count(old) != 1:
            why = "uncommitted changes" if dirty else f"{text.count(old)} matches of the text"
            print(f"NOT RUN  {name}: {f} has {why}")
            bad += 1
            continue
        t0 = time.monotonic()
        try:
            with open(path, "w") as fh:
                fh.write(text.replace(old, new))
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                *tests], cwd=ROOT, capture_output=True, text=True)
        finally:
            with open(path, "w") as fh:
                fh.write(text)
        lines = [ln for ln in r.stdout.splitlines() if ln.strip()] or [r.stderr.strip()[-200:]]
        caught = r.returncode != 0
        bad += not caught
        print(f"{'caught' if caught else 'MISSED'}  {name} ({time.monotonic() - t0:.0f} s): {lines[-1]}",
              flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
