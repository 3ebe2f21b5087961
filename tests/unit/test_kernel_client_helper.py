"""The tests' second client on a kernel (``helpers.kernelreply.connected``): a kernel
paused for a few seconds, as CI's loaded cores pause one, is waited for, not called
dead."""

import os
import signal
import threading

from helpers import kernelreply


def test_a_kernel_paused_past_the_default_heartbeat_is_still_reached():
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    try:
        first = km.client()
        first.start_channels()
        first.wait_for_ready(timeout=60)
        pid = first.execute_interactive("import os; pid = os.getpid()", timeout=60,
                                        user_expressions={"pid": "pid"})
        first.stop_channels()
        pid = int(pid["content"]["user_expressions"]["pid"]["data"]["text/plain"])
        os.kill(pid, signal.SIGSTOP)
        # 3 s: three of jupyter_client's 1-s heartbeats go unanswered
        resume = threading.Timer(3.0, os.kill, (pid, signal.SIGCONT))
        resume.start()
        try:
            kc = kernelreply.connected(km.connection_file, ready_s=30)
        finally:
            resume.join()
        try:
            msg_id = kc.execute("print(6 * 7)")
            assert kernelreply.reply_to(kc, msg_id, timeout=30)["content"]["status"] == "ok"
        finally:
            kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)
