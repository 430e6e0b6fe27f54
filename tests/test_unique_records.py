"""``unique_records``: every process's evaluation records, each once (one process here; the
gather is stood in for to play a padded distributed sampler), and the tasks that use it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import vision_attn.distributed as distributed
from vision_attn.distributed import unique_records
from vision_attn.tasks import CaptioningTask, ClassificationTask, DetectionTask


def test_one_process_drops_repeated_keys_in_first_occurrence_order():
    records = [{"index": 2, "v": "a"}, {"index": 0, "v": "b"}, {"index": 2, "v": "a"}, {"index": 1, "v": "c"}]
    assert [r["index"] for r in unique_records(records)] == [2, 0, 1]
    assert [r["index"] for r in unique_records(records, "index", sort=True)] == [0, 1, 2]
    assert records[1] in unique_records(records) and len(records) == 4  # the input is left alone


def test_the_key_is_a_field_name_or_a_function():
    records = [{"image_id": 7}, {"image_id": 3}, {"image_id": 7}]
    assert unique_records(records, "image_id") == [{"image_id": 7}, {"image_id": 3}]
    assert unique_records(records, lambda r: -r["image_id"], sort=True) == [{"image_id": 7}, {"image_id": 3}]
    assert unique_records([]) == []


def _padded_gather(monkeypatch, padding):
    """``gather_objects`` as two processes whose sampler padded the last batch with ``padding``."""
    def gather(items):
        return [*items, *padding]

    monkeypatch.setattr(distributed, "gather_objects", gather)


def test_repeats_of_a_padded_sampler_are_dropped(monkeypatch):
    _padded_gather(monkeypatch, [{"index": 0, "v": "x"}])
    assert unique_records([{"index": 1, "v": "y"}, {"index": 0, "v": "x"}], sort=True) == [
        {"index": 0, "v": "x"}, {"index": 1, "v": "y"}]


@pytest.mark.parametrize(("task", "key"), [(ClassificationTask, "index"), (CaptioningTask, "index"),
                                           (DetectionTask, "image_id")])
def test_tasks_gather_their_test_records_once_each(monkeypatch, task, key):
    _padded_gather(monkeypatch, [{key: 4, "rank": 1}])
    holder = SimpleNamespace(eval_records=[{key: 4, "rank": 1}, {key: 2, "rank": 0}])
    task.on_test_epoch_end(holder)
    assert holder.eval_records == [{key: 2, "rank": 0}, {key: 4, "rank": 1}]


def test_tasks_call_the_one_function(monkeypatch):
    import vision_attn.tasks.captioning_eval as captioning_eval
    import vision_attn.tasks.classification as classification
    import vision_attn.tasks.detection as detection

    calls = []
    for module in (classification, detection, captioning_eval):
        monkeypatch.setattr(module, "unique_records", lambda records, key, sort=False: calls.append(key) or [])
    for task in (ClassificationTask, DetectionTask, CaptioningTask):
        task.on_test_epoch_end(SimpleNamespace(eval_records=[]))
    assert calls == ["index", "image_id", "index"]
