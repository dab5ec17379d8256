"""The cause of a failed vLLM start, read from its log: real vLLM CPU logs (fixtures/vllm_logs, made by
starting vLLM 0.32 on a truncated tiny-moe shard and with BIGMOE_VRAM_SLOTS=zero) and the shapes around them."""

from __future__ import annotations

from pathlib import Path

import pytest
from bigmoe.serve.vllm_log import error_line, exit_reason, root_cause, stages_in

LOGS = Path(__file__).parent / "fixtures" / "vllm_logs"
ONEDNN = "onednn_verbose,info,cpu,runtime:OpenMP,nthr:2 oneDNN v3.7 (a warning printed on the way down)"


@pytest.mark.parametrize(
    "log,cause",
    [
        (
            "truncated_safetensors.log",
            "safetensors._safetensors_rust.SafetensorError: Error while deserializing header: "
            "incomplete metadata, file not fully covered",
        ),
        (
            "bad_bigmoe_setting.log",
            "bigmoe_pager.settings.SettingsError: BIGMOE_VRAM_SLOTS='zero' is not valid; "
            "expected a non-negative integer or a comma list of them, one per MoE layer",
        ),
    ],
)
def test_the_root_cause_of_real_vllm_failures(log, cause, tmp_path):
    text = (LOGS / log).read_text()
    assert root_cause(text) == cause
    assert "See root cause above" in text or "Traceback" in text  # the wrappers are there and not chosen
    noisy = tmp_path / log
    noisy.write_text(text + ONEDNN + "\n(APIServer pid=1) WARNING 12-01 12:00:00 [x.py:1] Error: not the cause\n")
    assert root_cause(noisy.read_text()) == cause
    message = exit_reason(1, noisy, " during start-up")
    assert message.startswith(cause + " (vLLM exited with code 1 during start-up; log: ")


@pytest.mark.parametrize(
    "lines,cause",
    [
        (
            [
                "INFO fine",
                "(EngineCore pid=3) ERROR 12-01 12:00:00 [core.py:1] ValueError: bad shape",
                "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
            ],
            "ValueError: bad shape",
        ),
        (
            [
                "usage: api_server.py [-h]",
                "api_server.py: error: argument --max-model-len: invalid int value: 'x'",
                ONEDNN,
            ],
            "api_server.py: error: argument --max-model-len: invalid int value: 'x'",
        ),
        (
            ["\x1b[31m(EngineCore pid=3) ERROR 12-01 12:00:00 [core.py:1] KeyError: 'experts'\x1b[0m"],
            "KeyError: 'experts'",
        ),
        (["INFO all fine", ONEDNN], None),
    ],
)
def test_root_cause_skips_wrappers_and_warnings(lines, cause):
    assert root_cause("\n".join(lines)) == cause


def test_a_killed_server_is_named_by_its_signal_not_a_log_line(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("ValueError: something earlier\n" + ONEDNN + "\n")
    assert exit_reason(-9, log, " while serving") == f"vLLM was killed by signal 9 (SIGKILL) while serving (log: {log})"


def test_a_log_with_no_error_says_so(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("INFO starting\n" + ONEDNN + "\n")
    assert exit_reason(2, log) == f"vLLM exited with code 2; its log states no error (log: {log})"
    assert error_line(log) == ONEDNN  # the TUI marks the last line when nothing better is there


def test_stages_of_a_real_start_that_failed_while_loading():
    assert stages_in(LOGS / "truncated_safetensors.log")[:2] == ["engine", "weights"]


DEAD = (
    "(APIServer pid=7) ERROR 12-01 13:03:09 [serving.py:1] vllm.v1.engine.exceptions.EngineDeadError: EngineCore "
    "encountered an issue. See stack trace (above) for the root cause."
)


def test_a_served_request_that_killed_the_engine_names_the_pager_error_not_the_wrapper():
    pager = (
        "bigmoe_pager.core.paging_file.PagingFileError: /cache/paging/tiny-moe-bf16.pages: record of layer 2, "
        "expert 0 fails its crc32 check twice; the file is marked damaged and the next start rebuilds it"
    )
    text = "\n".join(["INFO serving", f"(EngineCore pid=8) ERROR 12-01 13:03:08 [core.py:1] {pager}", DEAD])
    assert root_cause(text) == pager


def test_an_engine_killed_without_a_word_is_said_so():
    text = "\n".join(
        [
            "INFO serving",
            "(APIServer pid=7) WARNING 12-01 13:05:14 [core_client.py:1] [shutdown] MPClient: engine core "
            "exited unexpectedly; starting cleanup",
            DEAD,
            ONEDNN,
        ]
    )
    cause = root_cause(text)
    assert cause.startswith("vLLM's engine process ended without logging why") and "EngineDeadError" not in cause
