"""The file source: picks up changes, keeps the last good placement on a bad or missing file."""

from __future__ import annotations

import json

from kubelora.router.sources import FileSource, PlacementStore


def doc(revision: int) -> str:
    return json.dumps({"pool": "p", "baseModel": "b", "revision": revision,
                       "replicas": [{"pod": "p0", "url": "http://127.0.0.1:1", "ready": True}], "adapters": {}})


def test_file_source_follows_the_file_and_keeps_the_last_good(tmp_path):
    path = tmp_path / "placement.json"
    store = PlacementStore()
    source = FileSource(str(path), poll_interval=0.1)
    source.poll(store)
    assert store.placement is None and store.num_errors == 1
    source.poll(store)
    assert store.num_errors == 1  # one outage, one error
    path.write_text(doc(1))
    source.poll(store)
    source.poll(store)
    assert store.placement.revision == 1 and store.num_updates == 1  # unchanged bytes: no update
    path.write_text("{broken")
    source.poll(store)
    assert store.placement.revision == 1 and store.num_errors == 2
    path.write_text(doc(2))
    source.poll(store)
    assert store.placement.revision == 2
