"""bench/fastest_verifier.py: the capacity search's verifier is the fastest at the parity run's
middle stream count, and asynchronous scheduling (the default) only where the parity study found it
exact."""

import json

from bench.fastest_verifier import asynchronous_is_exact, candidates, fastest, main

VARIANTS = "sync - --no-vllm-async-scheduling;full - --vllm-cudagraph-mode FULL;one 0.001 --threads 1"


def _parity(**tok_s_at_24: float) -> dict:
    def row(streams: int, scale: float) -> dict:
        systems = {"vllm_alone": 1000.0, "vllm_sync": 800.0, "cloud_only": 100.0, "cloud_only stretch": 900.0}
        systems |= {label: value * scale for label, value in tok_s_at_24.items()}
        return {"streams": streams} | {label: {"tok_s": value} for label, value in systems.items()}

    # the first level favours cloud_only: the choice is made at the middle one (24) only
    return {"rows": [row(64, 1.0), row(1, 0.01), row(24, 1.0)]}


def test_variants_are_read_as_gpu_parity_reads_them() -> None:
    assert candidates(VARIANTS) == {
        "cloud_only": "",
        "sync": "--no-vllm-async-scheduling",
        "full": "--vllm-cudagraph-mode FULL",
        "one": "--threads 1",
    }
    assert candidates("") == {"cloud_only": ""}
    assert candidates("plain -; ") == {"cloud_only": "", "plain": ""}


def test_the_fastest_at_the_middle_stream_count_wins_peers_and_stretches_aside() -> None:
    parity = _parity(cloud_only=300.0, full=500.0, one=200.0)
    assert fastest(parity, candidates(VARIANTS), async_exact=True) == "--vllm-cudagraph-mode FULL"
    parity = _parity(cloud_only=300.0, full=250.0, one=310.0)
    assert fastest(parity, candidates(VARIANTS), async_exact=True) == "--threads 1"


def test_asynchronous_candidates_are_left_out_unless_found_exact() -> None:
    parity = _parity(cloud_only=300.0, full=500.0, sync=200.0, one=400.0)
    assert fastest(parity, candidates(VARIANTS), async_exact=False) == "--no-vllm-async-scheduling"
    assert fastest(parity, candidates("one 0.001 --threads 1"), async_exact=False) == "--no-vllm-async-scheduling"
    assert fastest(None, candidates(VARIANTS), async_exact=False) == "--no-vllm-async-scheduling"
    study = {"asynchronous_against_synchronous": {"all_equal": False}}
    assert not asynchronous_is_exact(study)
    assert not asynchronous_is_exact({"runs": {}})  # cut short before the comparison
    assert not asynchronous_is_exact(None)
    assert asynchronous_is_exact({"asynchronous_against_synchronous": {"all_equal": True}})


def test_no_parity_result_keeps_the_default(tmp_path, capsys) -> None:
    assert fastest(None, candidates(VARIANTS), async_exact=True) == ""
    assert main(["--parity", str(tmp_path / "missing.json"), "--variants", VARIANTS]) == 0
    assert capsys.readouterr().out == "--no-vllm-async-scheduling\n"  # and no parity study: asynchronous not allowed


def test_the_command_prints_the_chosen_flags(tmp_path, capsys) -> None:
    (tmp_path / "parity.json").write_text(json.dumps(_parity(cloud_only=300.0, full=500.0, one=200.0)))
    (tmp_path / "async.json").write_text(json.dumps({"asynchronous_against_synchronous": {"all_equal": True}}))
    argv = ["--parity", str(tmp_path / "parity.json"), "--async-parity", str(tmp_path / "async.json"), "--variants", VARIANTS]
    assert main(argv) == 0
    assert capsys.readouterr().out == "--vllm-cudagraph-mode FULL\n"


def test_bad_input_is_one_line_and_status_1(tmp_path, capsys) -> None:
    assert main([]) == 1
    assert capsys.readouterr().err == "python -m bench.fastest_verifier: error: parity: Field required\n"
    (tmp_path / "parity.json").write_text("{not json")
    assert main(["--parity", str(tmp_path / "parity.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m bench.fastest_verifier: error: ") and err.count("\n") == 1
