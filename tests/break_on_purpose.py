"""Break each behaviour on purpose, run the test that claims it, expect a failure.

    python tests/break_on_purpose.py [--fast] [WORD ...]

Each entry below is one deliberate break of dpnb (a changed constant, a
skipped call, a removed branch) and the tests that must fail because of it
-- the proof that those tests are not vacuous (tests/README.md).  The file is
changed in place and restored afterwards, even on Ctrl-C; run it on a clean
checkout (it refuses a tree with uncommitted changes to the files it breaks).
With WORDs, only the entries whose name contains one of them run; with
``--fast``, only those whose tests all lie in tests/unit (about a minute:
``.ci/run`` runs them after pytest, so CI fails when such a break goes
uncaught).  Exits 1
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
 ("the optimizer-step gate refuses a step after the NCCL watchdog's abort", "dpnb/engine/step.py",
  "    if err is not None:\n        raise TrainError(", "    if False:\n        raise TrainError(",
  ["tests/unit/test_release_gate.py::test_gate_refuses_a_step_after_the_watchdogs_abort"]),
 ("a device wait is a collective only while the last marked one is unfinished",
  "dpnb/engine/sidedoor.py",
  'if not device.collective_pending(getattr(state, "collective_mark", None)):',
  "if not device.queued_work(state.device):",
  ["tests/unit/test_device_wait.py::test_an_nccl_rank_waiting_on_its_gpu_is_inside_a_collective",
   "tests/unit/test_device_wait.py::test_a_rank_synchronizing_behind_its_own_compute_is_running_not_deadlocked"]),
 ("the cell guard marks each collective it passes under NCCL", "dpnb/engine/cellguard.py",
  "            out = fn(*args, **kwargs)\n            if g.nccl:\n                g.mark()\n            return out\n        st = g.state",
  "            return fn(*args, **kwargs)\n        st = g.state",
  ["tests/unit/test_device_wait.py::test_the_cell_guard_marks_each_collective_it_passes_under_nccl"]),
 ("NCCL's dumps go to the private folder", "dpnb/engine/netplan.py",
  '"nccl_trace_rank_")', '"..", "nccl_trace_rank_")',
  ["tests/unit/test_backend_env.py::test_nccl_dumps_go_to_the_private_folder_and_the_monitor_is_off"]),
 ("NCCL's heartbeat monitor is off", "dpnb/engine/netplan.py",
  'out["TORCH_NCCL_ENABLE_MONITORING"] = "0"', 'out["TORCH_NCCL_ENABLE_MONITORING"] = "1"',
  ["tests/unit/test_backend_env.py::test_nccl_dumps_go_to_the_private_folder_and_the_monitor_is_off"]),
 ("standin: save's agreement travels on the communication device", "dpnb/engine/checkpoint.py",
  "else 0], device=es.comm_device)", "else 0])",
  ["tests/standin/test_standin.py::test_save_and_load_on_an_nccl_like_group"]),
 ("standin: a re-formation after an aborting release rebinds from the group formed last",
  "dpnb/engine/setup.py",
  "old = dist.group.WORLD if dist.is_initialized() else st.group",
  "old = dist.group.WORLD if dist.is_initialized() else None",
  ["tests/standin/test_standin.py::test_release_abort_then_reform_rebinds_user_objects_by_identity"]),
 ("the default group timeout is torch's", "dpnb/core/timeouts.py",
  "    return TORCH_DEFAULT_TIMEOUT_S[backend]\n", "    return 30.0\n",
  ["tests/unit/test_backend_env.py::test_the_default_group_timeouts_are_torchs_own",
   "tests/cluster/test_busy_peer.py::test_the_default_group_timeout_is_torchs_on_every_rank"]),
 ("the store waits as long as the group once joined", "dpnb/engine/setup.py",
  "    store.set_timeout(timeout)\n", "",
  ["tests/cluster/test_busy_peer.py::test_the_default_group_timeout_is_torchs_on_every_rank"]),
 ("a wait for a busy rank is named while it runs", "dpnb/cluster/waiting.py",
  "        if WAITS_FOR_BUSY in verdict:", "        if False:",
  ["tests/cluster/test_busy_peer.py::test_a_busy_rank_is_waited_for_and_the_wait_is_named"]),
 ("a cell timeout is named only when given", "dpnb/cluster/diagnose.py",
  "    if res.cell_timeout_s:\n        return (f\"{rank_label(timed)} did not finish", "    if True:\n        return (f\"{rank_label(timed)} did not finish",
  ["tests/cluster/test_busy_peer.py::test_a_peer_given_up_at_the_group_timeout_is_reported_in_sentences_that_agree"]),
 ("no time saved is claimed after the group timeout", "dpnb/cluster/diagnose.py",
  "    if res.released and res.elapsed_s < timeout_s:", "    if res.released:",
  ["tests/cluster/test_busy_peer.py::test_a_peer_given_up_at_the_group_timeout_is_reported_in_sentences_that_agree"]),
 ("every rank seeds its own generators", "dpnb/engine/setup.py",
  'seeding.seed_rank(rank, info.get("seed"))', "None",
  ["tests/cluster/test_seeding.py::test_every_rank_draws_its_own_numbers_after_start_restart_and_replacement",
   "tests/ecosystem/test_seeding_like_torchrun.py"]),
 ("--seed gives rank r seed + r", "dpnb/engine/seeding.py",
  "return int(seed) + int(rank)", "return int(seed)",
  ["tests/cluster/test_seeding.py::test_seed_gives_rank_r_the_numbers_of_seed_plus_r_and_a_replacement_its_own_again"]),
 ("fresh seeds reach numpy", "dpnb/engine/seeding.py",
  "            np.random.seed()  # the OS's entropy\n", "            pass\n",
  ["tests/cluster/test_seeding.py::test_every_rank_draws_its_own_numbers_after_start_restart_and_replacement"]),
 ("an exported job keeps the seed", "dpnb/session/export.py",
  '(f", seed={seed})" if seed is not None else ")")', '")"',
  ["tests/cluster/test_seeding.py::test_an_exported_job_seeds_its_ranks_as_the_notebook_did"]),
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
 ("a script's siblings hide a cell's same-named module", "dpnb/engine/script.py",
  "        for k in self.hidden:\n            del sys.modules[k]\n", "        self.hidden = {}\n",
  ["tests/unit/test_script_world.py::test_each_script_imports_its_own_siblings_and_gives_the_modules_back"]),
 ("a script's siblings are forgotten after its run", "dpnb/engine/script.py",
  "if self.before.get(k) is not m and _owned(m, self.folder):", "if False:",
  ["tests/unit/test_script_world.py::test_each_script_imports_its_own_siblings_and_gives_the_modules_back",
   "tests/ecosystem/test_script_worlds.py::test_a_second_script_imports_its_own_sibling_and_is_reported_from_its_frames"]),
 ("a script's sys.path is the rank's again after it", "dpnb/engine/script.py",
  "        sys.path[:] = self.path\n", "        pass\n",
  ["tests/unit/test_script_world.py::test_each_script_imports_its_own_siblings_and_gives_the_modules_back"]),
 ("a script's report starts at its own frames", "dpnb/engine/script.py",
  "        _script_traceback(e, e.__traceback__.tb_next)", "        pass",
  ["tests/ecosystem/test_script_worlds.py::test_a_second_script_imports_its_own_sibling_and_is_reported_from_its_frames"]),
 ("reports name a script's file by its path", "dpnb/cluster/diagnose.py",
  "f\"{shown_path(m.group(2))} line {m.group(3)}\"", "f\"{m.group(2).rsplit('/', 1)[-1]} line {m.group(3)}\"",
  ["tests/unit/test_own_code_pure.py::test_user_line_is_the_innermost_frame_of_a_cell_or_of_the_users_file",
   "tests/ecosystem/test_script_worlds.py::test_a_second_script_imports_its_own_sibling_and_is_reported_from_its_frames"]),
 ("where names a script's file by its path", "dpnb/engine/frames.py",
  "f\"{shown_path(name)} line {line}\"", "f\"{os.path.basename(name)} line {line}\"",
  ["tests/unit/test_own_code_pure.py::test_frames_tell_cells_and_user_files_from_libraries",
   "tests/ecosystem/test_torchrun_scripts.py::test_where_names_the_line_of_a_running_script"]),
 ("device_id=cpu refused as torch refuses it", "dpnb/engine/lifecycle.py",
  'if device_id is not None and (device_id.index is None or device_id.type == "cpu"):', "if False:",
  ["tests/unit/test_script_world.py::test_what_torch_refuses_is_refused_as_torch_refuses_it",
   "tests/ecosystem/test_script_worlds.py::test_device_id_cpu_is_refused_as_torchrun_refuses_it"]),
 ("a timeout that is not a timedelta refused as torch refuses it", "dpnb/engine/lifecycle.py",
  "if timeout is not None and not isinstance(timeout, timedelta):", "if False:",
  ["tests/unit/test_script_world.py::test_what_torch_refuses_is_refused_as_torch_refuses_it"]),
 ("init_process_group's timeout is honoured", "dpnb/engine/lifecycle.py",
  "            hold_timeout(st, timeout.total_seconds())\n", "            pass\n",
  ["tests/ecosystem/test_script_worlds.py::test_the_scripts_timeout_holds_for_its_run_and_the_clusters_after"]),
 ("the cluster's timeout is back after the cell", "dpnb/engine/lifecycle.py",
  "                compat.set_group_timeout(st.timeout_s)\n", "                pass\n",
  ["tests/ecosystem/test_script_worlds.py::test_the_scripts_timeout_holds_for_its_run_and_the_clusters_after"]),
 ("pg_options refused", "dpnb/engine/lifecycle.py",
  "    if pg_options is not None:\n", "    if False:\n",
  ["tests/ecosystem/test_script_worlds.py::test_backend_options_are_refused_in_one_line"]),
 ("the re-form walks into objects: Fabric", "dpnb/core/objwalk.py",
  "    d = instance_dict(obj)\n", "    d = None\n",
  ["tests/ecosystem/test_libraries_hold_models.py::test_fabric_ddp_as_documented_trains_in_step_and_after_a_reform"]),
 ("the re-form walks into objects: Trainer", "dpnb/core/objwalk.py",
  "    d = instance_dict(obj)\n", "    d = None\n",
  ["tests/ecosystem/test_libraries_hold_models.py::test_hf_trainer_trains_and_trains_again_after_a_reform"]),
 ("the re-form walks into objects: lists, dicts, wrappers", "dpnb/core/objwalk.py",
  "    d = instance_dict(obj)\n", "    d = None\n",
  ["tests/ecosystem/test_libraries_hold_models.py::test_a_reform_moves_what_user_objects_hold_and_says_what_it_could_not",
   "tests/unit/test_objwalk.py::test_every_place_holding_the_object_is_found_and_assigned_without_running_user_code"]),
 ("a DDP is rebuilt in place", "dpnb/engine/rebind.py",
  "    DDP.__init__(ddp, before[", "    ddp = DDP(before[",
  ["tests/ecosystem/test_libraries_hold_models.py::test_fabric_ddp_as_documented_trains_in_step_and_after_a_reform"]),
 ("a re-form says what it could not move", "dpnb/engine/rebind.py",
  "            out.left.append(f\"{_label(hit)}: {_DEAD}\")", "            pass",
  ["tests/ecosystem/test_libraries_hold_models.py::test_a_reform_moves_what_user_objects_hold_and_says_what_it_could_not"]),
 ("engines carry torchrun's TORCHELASTIC_RUN_ID", "dpnb/engine/workerenv.py",
  "        \"TORCHELASTIC_RUN_ID\": info.get(\"run_id\") or \"dpnb\",\n", "",
  ["tests/ecosystem/test_libraries_hold_models.py::test_fabric_ddp_as_documented_trains_in_step_and_after_a_reform"]),
 ("engines have no interactive prompt", "dpnb/engine/workerenv.py",
  "            delattr(sys, name)", "            pass",
  ["tests/ecosystem/test_libraries_hold_models.py::test_fabric_ddp_as_documented_trains_in_step_and_after_a_reform"]),
 ("the walk's module children cost one level", "dpnb/core/objwalk.py",
  "step = 0 if slot.path.endswith(_AS_ATTR) else 1", "step = 1",
  ["tests/unit/test_objwalk.py::test_module_children_read_as_attributes_one_level_each"]),
 ("the walk stops at its bounds and says so", "dpnb/core/objwalk.py",
  "            truncated = True\n            break", "            break",
  ["tests/unit/test_objwalk.py::test_the_bounds_stop_the_walk_and_say_so"]),
 ("the walk leaves standard-library objects", "dpnb/core/objwalk.py",
  "    if _stdlib_leaf(obj):\n        return\n", "",
  ["tests/unit/test_objwalk.py::test_standard_library_objects_are_not_walked_into"]),
 ("calls paired across lines named", "dpnb/engine/checkstar.py",
  "verdict = (0 if not other_line else 2, agreed) if same else (1, 0)",
  "verdict = (0, agreed) if same else (1, 0)",
  ["tests/unit/test_collcheck.py::test_calls_paired_across_lines_are_kept_on_every_rank_and_still_run",
   "tests/cluster/test_mistakes.py::test_calls_paired_across_lines_are_named_in_the_report",
   "tests/cluster/test_mistakes.py::test_swapped_calls_and_branches_get_a_note_never_an_error"]),
 ("a loop whose line moves is not agreed", "dpnb/engine/collcheck.py",
  "        cur = (d, site)\n", "        cur = (d, None)\n        h = [(x, None) for x, _ in h]\n",
  ["tests/unit/test_collcheck.py::test_a_loop_whose_line_moves_is_not_agreed_but_a_branch_per_rank_is"]),
 ("point-to-point sizes checked", "dpnb/engine/cellguard.py",
  "            if p2p and g.should_check_p2p(", "            if False and g.should_check_p2p(",
  ["tests/ecosystem/test_p2p_ring.py::test_a_ring_with_one_index_off_is_an_error_naming_both_ends"]),
 ("P2POp lists go through the point-to-point check", "dpnb/engine/cellguard.py",
  "            if getattr(mod, name, None) is fn:\n                setattr(mod, name, w)",
  "            setattr(mod, name, _wrapped(guard, name, fn))",
  ["tests/ecosystem/test_p2p_ring.py::test_a_correct_hand_written_ring_gives_the_sum"]),
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
 # -- issue 39: the last rounds' features (profile, wire and store, side doors, %dp run,
 #    pdb, recovery's cell inference, placement, shared hosts)
 ("wire: a wrong proof gets no answer from the server", "dpnb/engine/wire.py",
  '    if not hmac.compare_digest(proof, mac(token, b"c", nonce, theirs)):\n        raise WireError("wrong token")',
  '    if False:\n        raise WireError("wrong token")',
  ["tests/unit/test_wire.py::test_the_servers_answer_nothing_to_a_wrong_proof_and_close"]),
 ("shared hosts: a wrong proof from another user is refused", "dpnb/engine/wire.py",
  '    if not hmac.compare_digest(proof, mac(token, b"c", nonce, theirs)):\n        raise WireError("wrong token")',
  '    if False:\n        raise WireError("wrong token")',
  ["tests/shared/test_other_user.py::test_store_and_side_doors_refuse_the_other_user"]),
 ("wire: the handshake has one deadline from accept", "dpnb/engine/wire.py",
  "    data = await asyncio.wait_for(reader.readexactly(NONCE + 32), max(left, 0.001))",
  "    data = await reader.readexactly(NONCE + 32)",
  ["tests/unit/test_wire.py::test_strangers_do_not_delay_the_store"]),
 ("store: compare_set on a missing key answers as TCPStore", "dpnb/engine/authstore.py",
  "            if (cur is None and not expected) or cur == expected:",
  "            if cur == expected:",
  ["tests/unit/test_wire.py::test_store_operations_match_tcpstore"]),
 ("side doors: a release is counted before the abort", "dpnb/engine/sidedoor.py",
  '        self.state.releases = getattr(self.state, "releases", 0) + 1\n', "",
  ["tests/unit/test_release_gate.py::test_release_counts_then_aborts_before_shutting_sockets"]),
 ("private folder: another user's 0700 folder is not ours", "dpnb/engine/private.py",
  "st.st_uid == os.getuid() and ", "",
  ["tests/unit/test_private.py::test_a_0700_folder_at_the_name_owned_by_another_user_is_not_used"]),
 ("private folder: a loose folder at the name is not ours", "dpnb/engine/private.py",
  " and not st.st_mode & 0o077", "",
  ["tests/unit/test_private.py::test_a_loose_folder_at_the_name_is_not_used"]),
 ("profile: a subset's straggler is named by its rank", "dpnb/core/profile.py",
  "    return Straggler(ranks[i].rank,", "    return Straggler(i,",
  ["tests/unit/test_core_profile.py::test_a_subset_profile_names_the_late_rank_by_its_rank_not_its_position"]),
 ("profile: a late span is cut one ring step after the first finisher", "dpnb/core/profile.py",
  "        limit = first + max(0.0, first - entered) / steps\n",
  "        limit = first + max(0.0, first - entered)\n",
  ["tests/unit/test_core_profile.py::test_a_span_closed_late_is_cut_at_the_first_finisher_plus_one_ring_step"]),
 ("profile: the typical lateness is the median", "dpnb/core/profile.py",
  "                     statistics.median(behind[i]), sum(behind[i]), max(behind[i]))",
  "                     min(behind[i]), sum(behind[i]), max(behind[i]))",
  ["tests/unit/test_core_profile.py::test_the_typical_lateness_is_not_hidden_by_a_tiny_collective"]),
 ("%dp run gives the rank's __main__ back", "dpnb/engine/script.py",
  '            mods["__main__"] = self.main\n', "            pass\n",
  ["tests/unit/test_script_world.py::test_main_is_the_script_during_its_run_and_the_ranks_again_after_even_a_failure"]),
 ("%dp run: the script is __main__ while it runs", "dpnb/engine/script.py",
  '    sys.modules["__main__"] = mod\n', "",
  ["tests/unit/test_script_world.py::test_main_is_the_script_during_its_run_and_the_ranks_again_after_even_a_failure"]),
 ("pdb: Ctrl-C at a prompt quits that rank's debugger", "dpnb/cluster/debugging.py",
  '            self._send(r, "q")  # Ctrl-C at the prompt', '            pass  # Ctrl-C at the prompt',
  ["tests/unit/test_own_code_pure.py::test_ctrl_c_at_a_pdb_prompt_quits_that_ranks_debugger_and_stops_the_cell"]),
 ("pdb: nobody to answer is said once, then the ranks go on", "dpnb/cluster/debugging.py",
  "        if self.cannot:  # said once already: let it go on\n", "        if False:\n",
  ["tests/unit/test_own_code_pure.py::test_the_desk_tells_a_rank_to_go_on_where_nobody_can_answer"]),
 ("pdb: a fed line runs in the rank's frame", "dpnb/engine/rankpdb.py",
  '        return line.rstrip("\\n") + "\\n"\n', '        return "continue\\n"\n',
  ["tests/unit/test_own_code_pure.py::test_the_rank_debugger_publishes_its_prompt_and_runs_the_lines_it_is_fed"]),
 ("recovery: cells changing a model in place are replayed", "dpnb/core/cellgraph.py",
  "            if name in lf.touches:\n", "            if False:\n",
  ["tests/unit/test_cellgraph.py::test_the_last_binding_and_its_inputs_as_of_its_place_in_the_history"]),
 ("recovery: a function reads its names as of its caller", "dpnb/core/cellgraph.py",
  'todo.append((r, f"cell {c.index}", max(before, pos + 1), False))',
  'todo.append((r, f"cell {c.index}", pos, False))',
  ["tests/unit/test_cellgraph.py::test_the_last_binding_and_its_inputs_as_of_its_place_in_the_history"]),
 ("recovery: a rank-selected binding is refused", "dpnb/core/cellgraph.py",
  "    if c.ranks is not None:\n        return f\"it ran on rank", "    if False:\n        return f\"it ran on rank",
  ["tests/unit/test_cellgraph.py::test_unreplayable_cells_are_left_out_with_their_reason",
   "tests/cluster/test_resume_inferred.py::test_a_name_no_replayable_cell_binds_is_refused_before_anything_is_replaced"]),
 ("placement: hosts in the user's order", "dpnb/cluster/placement.py",
  '        return sorted(eids, key=lambda e: (pos.get(probes[e].get("location") or "", far), e))',
  "        return eids",
  ["tests/unit/test_cluster_pure.py::test_hosts_follow_the_order_the_user_gave_not_who_registered_first"]),
 ("placement: the launcher's own rank orders Slurm and MPI", "dpnb/cluster/placement.py",
  "    if by_launch_rank and None not in launch and len(set(launch)) == len(launch):",
  "    if False:",
  ["tests/unit/test_cluster_pure.py::test_hosts_follow_the_order_the_user_gave_not_who_registered_first"]),
 ("an NCCL cluster's group serves CPU tensors through gloo", "dpnb/engine/netplan.py",
  '    return NCCL_GROUP if backend == "nccl" else backend\n', "    return backend\n",
  ["tests/unit/test_backend_env.py::test_an_nccl_cluster_gives_cpu_tensors_gloo_as_torch_does_for_both_names"]),
 ("dist.breakpoint honours timeout_s", "dpnb/engine/rankpdb.py",
  "            compat.set_other_groups_timeout(float(timeout_s))\n            hold_timeout(self.state, float(timeout_s))\n",
  "            pass\n",
  ["tests/unit/test_rank_breakpoint.py"]),
 ("NCCL's interface routes to the group, not the controller", "dpnb/engine/netplan.py",
  'info.get("data_ifname") or ""', 'info.get("ifname") or ""',
  ["tests/unit/test_backend_env.py::test_nccl_takes_the_route_to_the_group_not_the_controllers_vpn"]),
 ("pulled tensors arrive on the CPU", "dpnb/engine/runner.py",
  "serialize_object(to_host(ns[name]))", "serialize_object(ns[name])",
  ["tests/unit/test_pull_to_host.py"]),
 ("a GPU-per-task rank sees LOCAL_RANK 0", "dpnb/engine/workerenv.py",
  "        local, local_world, group, groups = 0, 1, rank, world\n", "        pass\n",
  ["tests/unit/test_gpu_plan.py::test_a_gpu_per_task_rank_sees_local_rank_0_as_srun_torchrun_gives_each_task"]),
 ("NCCL kernels are named by their c10d call", "dpnb/core/traces.py",
  "    launched = _launch_ops(spans) if on_device else {}", "    launched = {}",
  ["tests/unit/test_core_profile.py::test_nccl_kernels_are_named_by_the_c10d_call_that_launched_them"]),
 ("a CPU tensor moved by .cpu() into an engine collective is caught", "dpnb/engine/setup.py",
  "    t = torch.ones(1, device=st.device)\n", "    t = torch.ones(1, device=st.device).cpu()\n",
  ["tests/unit/test_comm_device.py::test_engine_code_makes_collective_tensors_on_the_comm_device"]),
 # issue 41: the error summary reads the re-form's flag, not a word in its message
 ("a group left unformed is not summarised as re-formed", "dpnb/cluster/diagnose.py",
  "    if reformed:  # the flag", '    if reform_msg and "re-formed" in reform_msg:  # the flag',
  ["tests/unit/test_cluster_pure.py::test_a_group_left_unformed_is_not_summarised_as_re_formed"]),
 ("a view's error is one class on the ranks and in the notebook", "dpnb/widgets/_common.py",
  "from ..core.errors import ViewError  # one class",
  "from ..core.errors import UserError\n\n\nclass ViewError(UserError, ValueError):\n    pass  # one class",
  ["tests/unit/test_user_errors.py::test_each_error_name_is_one_class"]),
 ("a failed start stops what it spawned, when ipyparallel's stop does not", "dpnb/cluster/launch.py",
  "    wait_pids_gone(left, timeout=STOP_WAIT_S)\n", "",
  ["tests/cluster/test_failed_start.py::test_a_failed_start_whose_ipyparallel_stop_does_nothing_leaves_no_process"]),
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


def fast(entry) -> bool:
    """Every test of the entry is in the unit tier (no cluster, no kernel)."""
    return all(t.startswith("tests/unit/") for t in entry[4])


def main(words: list[str]) -> int:
    only_fast = "--fast" in words
    words = [w for w in words if w != "--fast"]
    chosen = [m for m in MUTATIONS if (not words or any(w in m[0] for w in words))
              and (fast(m) or not only_fast)]
    if not chosen:
        print(f"NOT RUN  no entry matches {' '.join(words)}")
        return 1
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
