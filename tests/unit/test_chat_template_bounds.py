"""Chat templates render within the limits sweep prompts have (batchrun/templating.py): a
template that does not finish, or writes too much, is that line's error and the run goes on.
The bundled model's real tokenizer on the fake engine."""

import json
import re
import time

import pytest

from batchrun import templating
from batchrun.batch.job.runner import run_batch
from batchrun.models.text import chat_template
from batchrun.models.text.tokenizer import load_tokenizer
from batchrun.models.weights.resolve import resolve_model
from tests.fake_engine import fake_model
from tests.helpers import job_plan
from tests.openai_batch_shape import error_of

# Renders every message; a message containing "loop" sends it into 10^10 loop steps.
ENDLESS = ("{% for m in messages %}{% if m.content is string and 'loop' in m.content %}"
           "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def line(custom_id, text):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "max_tokens": 2,
                                "messages": [{"role": "user", "content": text}]}})


def test_a_template_that_does_not_finish_is_that_lines_error(tmp_path, monkeypatch):
    monkeypatch.setattr(templating, "RENDER_SECONDS", 0.3)
    model = fake_model()
    model.tokenizer = load_tokenizer(resolve_model(None).path)
    (tmp_path / "t.jinja").write_text(ENDLESS)
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([line("a", "hi"), line("b", "please loop"), line("c", "bye")]) + "\n")
    plan = job_plan(input=str(src), output=str(tmp_path / "out.jsonl"), progress="none",
                    ignore_model_field=True, chat_template=str(tmp_path / "t.jinja"))
    started = time.monotonic()
    result = run_batch(model, plan)
    assert time.monotonic() - started < 10
    assert result.status == "completed"
    ok = [json.loads(x)["custom_id"] for x in open(tmp_path / "out.jsonl")]
    (failed,) = map(json.loads, open(tmp_path / "out.errors.jsonl"))
    assert ok == ["a", "c"] and failed["custom_id"] == "b"
    error = error_of(failed)
    assert error["code"] == "invalid_messages" and "took over 0.3 s" in error["message"]
    assert "line 2" in error["message"]


@pytest.mark.parametrize("source, words", [
    ("{{ ('a' * 1000000) * 1000000 }}", "repetition of more than"),
    ("{% for i in range(100) %}{{ 'y' * 1000000 }}{% endfor %}", "passed 16777216 characters"),
    ("{{ range(10**7) }}", "range() of 10000000 items"),
])
def test_what_one_render_may_write_is_bounded(source, words):
    with pytest.raises(templating.RenderError, match=re.escape(words)):
        chat_template.render(source, [{"role": "user", "content": "hi"}], {})


def test_template_errors_keep_their_kind_and_ranges_behave_as_ranges():
    """raise_exception is still a TemplateError (as in transformers); range() gives a
    sequence (length, indexing, reversed) as Jinja's own does."""
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="no system"):
        chat_template.render("{{ raise_exception('no system') }}",
                             [{"role": "user", "content": "hi"}], {})
    text = chat_template.render(
        "{{ range(5)|length }} {{ range(5)[2] }} {{ range(3)|reverse|join(',') }}"
        " {% for i in range(2) %}{{ loop.length }}{% endfor %}",
        [{"role": "user", "content": "hi"}], {})
    assert text == "5 2 2,1,0 22"
