"""A workdir on an object store: ``gs://`` through a local Cloud Storage emulator (gcp-storage-emulator), which,
like GCS, has no rename and no append. Training, resuming, evaluating and ``info`` run on it end to end."""

import json
import logging
import os
import socket

import pytest

from tests.helpers import TINY, run_in_new_process, train_args

pytestmark = pytest.mark.xdist_group("object_store")  # one worker builds the module's fixture once

try:  # both come with the dev extra; outside CI a plain install may lack them, under CI that is a failure
    import gcsfs  # noqa: F401
    from gcp_storage_emulator import server as emulator
except ImportError as e:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip(f"needs the dev extra (gcp-storage-emulator, gcsfs): {e}", allow_module_level=True)

BUCKET = "qkvjax-test"


def _send_generation(download):
    """GCS answers every object download with its generation in ``x-goog-generation`` (tensorstore's conditional
    reads of OCDBT manifests need it); the emulator leaves that header out, so its download handler gets it here."""

    def handler(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = obj["generation"]
        except Exception:  # not found: the emulator's handler answers 404
            pass
        return download(request, response, storage, *args, **kwargs)

    handler.sends_generation = True
    return handler


def _move(request, response, storage, *args, **kwargs):
    """GCS's ``objects.move`` (``POST .../o/SRC/moveTo/o/DST``), which the emulator lacks: gcsfs tries it first for
    every rename and retries the emulator's 501 with backoff for about 35 s before falling back to a copy and a
    delete, which made this test over twice as long (104 s against 40). Answered as GCS does: copy, then delete."""
    from gcp_storage_emulator.handlers import objects

    request.params["dest_bucket_name"] = request.params["bucket_name"]
    objects.copy(request, response, storage)
    if response.status == 200:
        storage.delete_file(request.params["bucket_name"], request.params["object_id"])


def _move_route(prefix: str):
    pattern = rf"^{prefix}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$"
    return pattern, {emulator.POST: _move}


@pytest.fixture(scope="module")
def gcs():
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    from gcp_storage_emulator.handlers import objects

    if not getattr(objects.download, "sends_generation", False):
        original = objects.download
        objects.download = _send_generation(original)  # also reached through objects.get (?alt=media)
        for _, handlers in emulator.HANDLERS:
            if handlers.get(emulator.GET) is original:
                handlers[emulator.GET] = objects.download
    if not any(handlers.get(emulator.POST) is _move for _, handlers in emulator.HANDLERS):
        emulator.HANDLERS = (_move_route("/storage/v1"), _move_route("")) + tuple(emulator.HANDLERS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    url = f"http://127.0.0.1:{port}"
    # gcsfs and tensorstore (orbax's array store) both talk to the emulator instead of Google.
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_CLOUD_PROJECT": "test"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # for this process and the CLI processes it starts
    try:
        yield env
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cli(args, env):
    return run_in_new_process(args, devices=2)


def test_train_resume_eval_and_info_on_gs(gcs, small_text, data_dir):
    from etils import epath

    w = f"gs://{BUCKET}/run"
    common = {"train.checkpoint_every": 2, "train.batch_size": 4}
    first = _cli(train_args(w, small_text, data_dir, **common, **{"train.num_steps": 4}), gcs)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    root = epath.Path(w)
    assert (root / "checkpoints" / "4" / "commit_success.txt").exists()  # orbax's commit marker, no rename
    assert not (root / "train.lock").exists()

    second = _cli(train_args(w, small_text, data_dir, **common, **{"train.num_steps": 6}), gcs)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "resumed from checkpoint step 4" in second.stdout
    records = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if not r.get("eval")] == [1, 2, 3, 4, 5, 6]
    assert any(name.name.endswith(".from_step_4") for name in (root / "tensorboard").iterdir())
    assert sorted(int(p.name) for p in (root / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4, 6]

    ev = _cli(["eval", f"--workdir={w}"], gcs)
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["step"] == 6 and result["loss"] > 0
    info = _cli(["info", f"--workdir={w}", "--json"], gcs)
    assert info.returncode == 0, info.stderr[-3000:]
    assert json.loads(info.stdout)["workdir"] == w


def test_a_prepared_corpus_on_gs_streams_the_windows_a_local_copy_gives(gcs, tmp_path):
    """``data.prepared=gs://...``: the manifest, the shards' lengths and sha256 checked over the object store, and
    windows read by ranged reads equal to the local memory map's; a two-step run trains on it."""
    import numpy as np
    from etils import epath

    from qkvjax.data.pipeline import train_batches
    from qkvjax.data.prepare import prepare
    from qkvjax.data.shards import open_corpus

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"d{i}.txt").write_text(f"document {i}: " + "the lazy dog jumps over the fox " * (i + 3) + "\n")
    local = tmp_path / "prepared"
    prepare([str(docs)], str(local), "bytes", val_fraction=0.3, workers=1, shard_mb=0.002)
    remote = epath.Path(f"gs://{BUCKET}/prepared")
    for f in local.rglob("*"):
        if f.is_file():
            (remote / f.relative_to(local)).parent.mkdir(parents=True, exist_ok=True)
            (remote / f.relative_to(local)).write_bytes(f.read_bytes())
    near, far = open_corpus(str(local)), open_corpus(str(remote))
    assert far.sha256 == near.sha256 and len(far.manifest["splits"]["train"]["shards"]) > 2
    far.verify().wait()
    a = train_batches(near.split("train"), 16, 4, seed=1, sampling="disjoint")
    b = train_batches(far.split("train"), 16, 4, seed=1, sampling="disjoint")
    for _ in range(5):
        np.testing.assert_array_equal(next(a)["inputs"], next(b)["inputs"])
    args = ["train", f"--config={TINY}", f"--workdir={tmp_path / 'run'}", f"--config.data.prepared={remote}",
            "--config.train.num_steps=2", "--config.train.batch_size=4", "--config.train.peak_flops=1e11"]  # fmt: skip
    run = _cli(args, gcs)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "step 2/2" in run.stdout
