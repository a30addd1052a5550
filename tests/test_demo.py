"""The README's demo commands keep working and tell their story: each tenant's adapter answers in its own style,
every served answer equals transformers+PEFT's on the same files, and no temporary folder stays behind.

The model and adapters come from the demo's cache (~/.cache/kubelora/demo, trained in about 30 s when absent).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kubelora.cli import story

TENANTS = tuple(story.TENANTS)
ANSWER = re.compile(r"^   \[\s*(\S+)\] (.+?) ->(.*)$")


def _demo(tmp_path, *args: str) -> str:
    # TMPDIR: the demo's temporary folder lands here, so the test sees whether it was removed.
    env = {**os.environ, "PYTHONSAFEPATH": "1", "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-P", "-m", "kubelora.cli.main", "demo", *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # (torch keeps its compile cache, torchinductor_<user>, in TMPDIR too: that one is torch's, and shared)
    assert list(tmp_path.glob("kubelora-demo-*")) == [], "the demo left its temporary folder behind"
    return result.stdout


def _answers(out: str) -> dict[tuple[str, str], str]:
    """{(model, prompt): text} of the completion lines, each checked against the next line's verdict."""
    lines = out.splitlines()
    answers = {}
    for line, verdict in zip(lines, lines[1:]):
        match = ANSWER.match(line)
        if match and match.group(2) in story.PROMPTS:
            assert verdict.strip() == "= transformers+PEFT's answer", (line, verdict)
            answers[(match.group(1), match.group(2))] = match.group(3)
    return answers


def _assert_the_story(answers: dict[tuple[str, str], str]) -> None:
    assert set(answers) == {(m, p) for m in ("base", *TENANTS) for p in story.PROMPTS}
    for prompt in story.PROMPTS:
        texts = [answers[(model, prompt)] for model in ("base", *TENANTS)]
        assert len(set(texts)) == len(texts), f"two adapters gave the same answer to {prompt!r}"
        for tenant in TENANTS:
            text = answers[(tenant, prompt)]
            assert all(word in text for word in story.STYLE_WORDS[tenant]), (tenant, text)
            others = [w for other in TENANTS if other != tenant for w in story.STYLE_WORDS[other]]
            assert not any(word in text for word in others), (tenant, text)
        assert not any(w in answers[("base", prompt)] for t in TENANTS for w in story.STYLE_WORDS[t])
        assert re.fullmatch(r"[A-Za-z' ,.!/4]+", answers[("base", prompt)].strip())  # readable text


def test_served_demo_answers_in_each_tenants_style_through_the_http_server(tmp_path):
    out = _demo(tmp_path, "--engine-only")
    _assert_the_story(_answers(out))
    for name in TENANTS:
        assert f"load {name}: 200" in out
    assert "== 13 of 13 answers equal transformers+PEFT's" in out  # 12 completions and the streamed chat
    chat = out.split("== streamed chat with pirate: Tell me about the weather.\n", 1)[1].splitlines()
    assert "matey" in chat[0] and chat[1].strip() == "= transformers+PEFT's answer"
    assert "load ../../etc: 400" in out
    assert "completion for the unloaded pirate: 404" in out
    # every answer ends on its own (EOS), within max_tokens
    assert 'kubelora_requests_total{adapter="haiku",finish_reason="stop"} 3.0' in out


def test_offline_demo_answers_in_each_tenants_style(tmp_path):
    out = _demo(tmp_path, "--offline")
    _assert_the_story(_answers(out))
    assert "== 12 of 12 answers equal transformers+PEFT's" in out


def test_the_references_are_transformers_and_peft_answers_in_each_style():
    """references.json (written by transformers+PEFT when the adapters were trained): the demo's yardstick."""
    references = story.references()
    for form in ("completion", "chat"):
        answers = {(m, p): references[form][story.reference_key(None if m == "base" else m, p)]
                   for m in ("base", *TENANTS) for p in story.PROMPTS}
        _assert_the_story(answers)


def test_a_cached_demo_copies_the_artifacts_without_training(tmp_path, monkeypatch):
    story.ensure_artifacts()  # trained once (or already cached)
    monkeypatch.setattr(story, "train_all", lambda *a, **k: pytest.fail("retrained a cached model"))
    model, adapters = story.copy_artifacts(tmp_path)
    assert (model / "model.safetensors").is_file() and (model / "tokenizer.json").is_file()
    assert sorted(adapters) == sorted(TENANTS)
    for path in adapters.values():
        assert (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()
    assert oct((model / "model.safetensors").stat().st_mode & 0o777) == "0o644"  # the pods' uid reads it


def test_a_failed_cluster_step_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    """A step that fails (here: helm's build) ends the cluster demo with exit code 1 and one account naming the
    step and the error, not a traceback; the cluster is left as it was found."""
    from kubelora.cli import demo_cluster

    calls = []
    monkeypatch.setattr(demo_cluster, "build_demo_material", lambda workdir: None)
    monkeypatch.setattr(demo_cluster, "_cluster",
                        lambda *args, **kwargs: calls.append(args) or subprocess.CompletedProcess(args, 1, "", ""))

    def broken_helm():
        raise RuntimeError("e2e/helm/build.sh failed (1); its output is above")

    monkeypatch.setattr(demo_cluster, "_build_helm", broken_helm)
    assert demo_cluster.run_cluster_demo(tmp_path, keep=False) == 1
    err = capsys.readouterr().err
    assert "the demo failed while 'building helm from the Go module proxy (first use only)'" in err
    assert "e2e/helm/build.sh failed (1)" in err and "Traceback" not in err
    assert calls == [("status",)], "nothing started, so nothing to stop"


def test_a_garbled_base_answer_is_said_to_be_the_tiny_models():
    from kubelora.cli.demo import base_note

    prompt = story.PROMPTS[1]
    trained = story.BASE_ANSWERS[1]
    note = base_note(prompt, "  to to to to to to to image, push to a registry, then apply")
    assert note and "learned little" in note and trained in note
    assert base_note(prompt, f" {trained}") is None  # the answer it was trained on needs no word
