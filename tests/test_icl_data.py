"""LLM Foundry's ICL files fetched on first use: checked, cached, or read from a local copy; clear errors."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import pytest

from foundry.errors import ConfigError, DataError
from foundry.eval.task_config import parse_gauntlet, parse_icl_tasks
from foundry.icl_data import local_file, recorded_path, sources, task_list_path

COPA = "local_data/commonsense_reasoning/copa.jsonl"


def test_a_file_is_downloaded_checked_and_cached_then_read_from_the_cache(icl_server, shared_data) -> None:
    first = local_file(COPA)
    second = local_file(COPA)
    assert first == second
    assert first.read_bytes() == (shared_data / "icl/commonsense_reasoning/copa.jsonl").read_bytes()
    assert icl_server.requests == [f"/{COPA}"]  # the second call read the cache


def test_a_file_whose_checksum_differs_is_refused_and_not_cached(icl_server, tmp_path) -> None:
    (icl_server.root / "local_data").unlink()  # serve an altered copa.jsonl under the recorded name
    altered = icl_server.root / COPA
    altered.parent.mkdir(parents=True)
    altered.write_text('{"query": "altered", "choices": ["a", "b"], "gold": 0}\n')
    with pytest.raises(DataError, match="checksum") as error:
        local_file(COPA)
    assert f"{icl_server.url}/{COPA}" in str(error.value)
    assert not list((tmp_path / "cache").rglob("copa.jsonl"))


def test_a_missing_file_names_the_url_and_the_offline_option(icl_server) -> None:
    missing = "local_data/language_understanding/hellaswag.jsonl"  # recorded, not in the shared copy
    with pytest.raises(DataError, match="HTTP 404") as error:
        local_file(missing)
    assert f"{icl_server.url}/{missing}" in str(error.value)
    assert "--icl-data" in str(error.value)


def test_an_unreachable_server_names_the_url_and_the_offline_option(tmp_path, monkeypatch) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("FOUNDRY_ICL_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("FOUNDRY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FOUNDRY_ICL_DATA", raising=False)
    with pytest.raises(DataError, match="Could not download") as error:
        local_file(COPA)
    assert f"http://127.0.0.1:{port}/{COPA}" in str(error.value)
    assert "--icl-data" in str(error.value)


def test_a_local_copy_is_read_without_downloading(icl_copy, monkeypatch) -> None:
    monkeypatch.setenv("FOUNDRY_ICL_URL", "http://127.0.0.1:9")  # would fail if used
    monkeypatch.setenv("FOUNDRY_ICL_DATA", str(icl_copy))
    assert local_file(COPA) == icl_copy / COPA
    monkeypatch.setenv("FOUNDRY_ICL_DATA", str(icl_copy / "local_data"))  # the local_data folder alone
    assert local_file(COPA) == icl_copy / "local_data" / "commonsense_reasoning/copa.jsonl"


def test_a_local_copy_without_the_file_names_what_it_looked_for(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FOUNDRY_ICL_DATA", str(tmp_path))
    with pytest.raises(DataError, match=f"{tmp_path / COPA}"):
        local_file(COPA)


def test_llm_foundry_paths_and_names_resolve_to_its_files() -> None:
    arc_easy = "local_data/world_knowledge/arc_easy.jsonl"
    assert recorded_path(f"eval/{arc_easy}") == arc_easy
    assert recorded_path("/somewhere/my_tasks/arc_easy.jsonl") is None
    assert recorded_path("eval/yamls/tasks_v0.3.yaml") == "yamls/tasks_v0.3.yaml"


def test_task_lists_by_name_are_llm_foundrys(icl_server) -> None:
    tasks = parse_icl_tasks("light")
    assert "hellaswag" in [task.label for task in tasks]
    assert task_list_path("eval/yamls/tasks_v0.3.yaml", "icl_tasks").name == "tasks_v0.3.yaml"
    gauntlet = parse_gauntlet("v0.3")
    assert "world_knowledge" in [category.name for category in gauntlet.categories]


def test_an_unknown_task_list_name_lists_the_known_ones(icl_server) -> None:
    with pytest.raises(ConfigError, match=r"v0\.3") as error:
        parse_icl_tasks("lite")
    assert "'lite'" in str(error.value)


def test_recorded_checksums_match_the_shared_copy(shared_data) -> None:
    """icl_sources.json was computed from these files; a wrong sum would refuse every download of one."""
    files = sources()["files"]
    checked = 0
    for recorded, expected in files.items():
        local = shared_data / "icl" / recorded.removeprefix("local_data/").replace("yamls/", "reference/")
        if local.is_file() and expected.startswith("sha256:"):
            assert expected == f"sha256:{hashlib.sha256(local.read_bytes()).hexdigest()}", recorded
            checked += 1
    assert checked >= 60


def test_every_task_file_of_the_recorded_lists_is_recorded(shared_data) -> None:
    files = sources()["files"]
    for name in ("tasks_light", "tasks_v0.3"):
        for task in parse_icl_tasks(shared_data / "icl" / "reference" / f"{name}.yaml"):
            assert recorded_path(task.dataset_uri) in files, (name, task.dataset_uri)


def test_the_sources_file_pins_one_commit_of_llm_foundry() -> None:
    data = json.loads((Path(__file__).resolve().parents[1] / "foundry" / "icl_sources.json").read_text())
    assert data["repository"] == "mosaicml/llm-foundry"
    assert len(data["commit"]) == 40
    assert "{commit}" in data["url"] and "raw.githubusercontent.com" in data["url"]


def test_a_tampered_cached_file_is_fetched_again_before_use(icl_server, shared_data) -> None:
    cached = local_file(COPA)
    cached.write_text('{"query": "tampered", "choices": ["a", "b"], "gold": 0}\n')
    assert local_file(COPA).read_bytes() == (shared_data / "icl/commonsense_reasoning/copa.jsonl").read_bytes()
    assert icl_server.requests == [f"/{COPA}", f"/{COPA}"]


def test_a_tampered_cached_file_that_cannot_be_fetched_again_is_refused(icl_server, monkeypatch) -> None:
    cached = local_file(COPA)
    cached.write_text('{"query": "tampered", "choices": ["a", "b"], "gold": 0}\n')
    monkeypatch.setenv("FOUNDRY_ICL_URL", "http://127.0.0.1:9")  # offline now
    with pytest.raises(DataError, match="does not match the checksum") as error:
        local_file(COPA)
    assert str(cached) in str(error.value)


@pytest.fixture
def local_data_copy(tmp_path, monkeypatch) -> Path:
    """A copy of LLM Foundry's scripts/eval/local_data (one task file), named by --icl-data; an empty cache."""
    folder = tmp_path / "eval" / "local_data"
    (folder / "commonsense_reasoning").mkdir(parents=True)
    (folder / "commonsense_reasoning" / "copa.jsonl").write_text('{"query": "q", "choices": ["a", "b"], "gold": 0}\n')
    monkeypatch.setenv("FOUNDRY_ICL_DATA", str(folder))
    monkeypatch.setenv("FOUNDRY_CACHE_DIR", str(tmp_path / "cache"))
    return folder


def test_a_local_data_copy_reads_named_lists_from_the_yamls_folder_beside_it(local_data_copy) -> None:
    lists = local_data_copy.parent / "yamls"
    lists.mkdir()
    (lists / "tasks_light.yaml").write_text("icl_tasks: []\n")
    assert task_list_path("light", "icl_tasks") == lists / "tasks_light.yaml"


def test_a_local_data_copy_alone_says_what_named_lists_need(local_data_copy, capsys) -> None:
    from foundry.cli import main

    model = str(local_data_copy.parent)  # exists: the model path is checked before the task lists, never loaded
    code = main(["eval", "--model", model, "--tasks", "light", "--icl-data", str(local_data_copy)])
    err = capsys.readouterr().err
    assert code == 2
    assert "has no task list yamls/tasks_light.yaml" in err and "whole scripts/eval folder" in err
    assert "--tasks path/to/tasks_light.yaml" in err
