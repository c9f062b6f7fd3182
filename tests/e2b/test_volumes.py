"""Volumes through the unmodified SDK's `Volume` API: `Volume.create`,
`list`, `get_info`, `connect`, `destroy` (sync and async), and
`Sandbox.create(volume_mounts=...)` mounting them; the refusals in E2B's
words: a volume another sandbox writes, a delete while mounted, a system
path, an unknown or another key's volume."""

import pytest
import requests
from e2b import AsyncVolume, Sandbox, Volume
from e2b.exceptions import SandboxException, VolumeException, VolumeNotFoundException


def test_a_volume_is_made_mounted_and_outlives_its_sandboxes(daemon):
    vol = Volume.create("e2b-data")
    try:
        assert vol.volume_id.startswith("vol-") and vol.name == "e2b-data"
        assert vol.volume_id in [v.volume_id for v in Volume.list()]
        info = Volume.get_info(vol.volume_id)
        assert info.volume_id == vol.volume_id and info.name == "e2b-data"
        assert Volume.connect(vol.volume_id).name == "e2b-data"
        # The native view: the default size, mounted by nobody yet.
        r = requests.get(f"{daemon['base']}/v1/volumes/{vol.volume_id}",
                         headers={"Authorization": f"Bearer {daemon['key']}"}, timeout=10)
        assert r.json()["size_mib"] == 1024 and r.json()["mounted_by"] == [], r.text
        sb = Sandbox.create(volume_mounts={"/data": vol})
        try:
            sb.commands.run("echo kept > /data/a.txt")
            mounts = Sandbox.get_info(sb.sandbox_id).volume_mounts
            assert mounts == [{"name": "e2b-data", "path": "/data"}], mounts
            # Read-write by one sandbox at a time.
            with pytest.raises(SandboxException) as e:
                Sandbox.create(volume_mounts={"/mnt/v": "e2b-data"})
            assert e.value.status_code == 409 and "mounted by" in str(e.value), e.value
            # Not deleted while mounted.
            with pytest.raises(VolumeException) as e:
                Volume.destroy(vol.volume_id)
            assert "409" in str(e.value), e.value
        finally:
            sb.kill()
        # By name, elsewhere: the files are there.
        sb = Sandbox.create(volume_mounts={"/mnt/v": "e2b-data"})
        try:
            assert sb.files.read("/mnt/v/a.txt") == "kept\n"
        finally:
            sb.kill()
    finally:
        assert Volume.destroy(vol.volume_id) is True
    assert Volume.destroy(vol.volume_id) is False
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vol.volume_id)
    assert vol.volume_id not in [v.volume_id for v in Volume.list()]


def test_bad_mounts_and_another_keys_volume_are_refused(daemon):
    d = daemon["daemon"]
    other = d.opts(d.make_key("e2b-volume-other"))
    vol = Volume.create("e2b-private")
    try:
        with pytest.raises(SandboxException) as e:
            Sandbox.create(volume_mounts={"/etc": vol})
        assert e.value.status_code == 400 and "/etc" in str(e.value), e.value
        with pytest.raises(SandboxException) as e:
            Sandbox.create(volume_mounts={"/data": "no-such-volume"})
        assert e.value.status_code == 404, e.value
        assert Volume.list(**other) == []
        with pytest.raises(VolumeNotFoundException):
            Volume.get_info(vol.volume_id, **other)
        assert Volume.destroy(vol.volume_id, **other) is False
        with pytest.raises(SandboxException) as e:
            Sandbox.create(volume_mounts={"/data": "e2b-private"}, **other)
        assert e.value.status_code == 404, e.value
        # A name taken is E2B's conflict.
        with pytest.raises(VolumeException):
            Volume.create("e2b-private")
        assert Volume.get_info(vol.volume_id).name == "e2b-private"
    finally:
        Volume.destroy(vol.volume_id)


async def test_the_async_volume_api(daemon):
    vol = await AsyncVolume.create("e2b-async")
    try:
        assert vol.volume_id in [v.volume_id for v in await AsyncVolume.list()]
        assert (await AsyncVolume.get_info(vol.volume_id)).name == "e2b-async"
    finally:
        assert await AsyncVolume.destroy(vol.volume_id) is True
    assert await AsyncVolume.destroy(vol.volume_id) is False
