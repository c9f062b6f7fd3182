"""Volumes through the SDK, sync and async: create, list, get, resize and
delete, and sandboxes that mount them (`volumes=`), with the refusals as
typed errors."""

from __future__ import annotations

import hutch
import pytest

from conftest import marker


def test_volume_create_mount_resize_delete(client: hutch.Hutch):
    name = f"sdk-{marker()}"
    v = client.volumes.create(name, size_mib=32)
    try:
        assert isinstance(v, hutch.Volume) and v.id.startswith("vol-") and v.name == name and v.size_mib == 32
        assert v.mounted_by == [] and v.id in [x.id for x in client.volumes.list()]
        assert client.volumes.get(name).id == v.id
        with pytest.raises(hutch.ConflictError) as e:
            client.volumes.create(name)
        assert e.value.code == "volume_name_taken"
        with client.sandboxes.create(ttl="5m", volumes=[f"{name}:/data"]) as sb:
            assert sb.exec("echo kept > /data/a").exit_code == 0
            held = client.volumes.get(v)
            assert held.mounted_by == [hutch.VolumeHolder(sb.id, "/data", False)]
            with pytest.raises(hutch.ConflictError) as e:
                client.sandboxes.create(volumes=[{"name": name, "path": "/mnt/x", "read_only": True}])
            assert e.value.code == "volume_in_use"
            with pytest.raises(hutch.ConflictError) as e:
                client.volumes.delete(v)
            assert e.value.code == "volume_in_use"
        with client.sandboxes.create(ttl="5m", volumes=[{"name": v.id, "path": "/mnt/v", "read_only": True}]) as sb:
            assert sb.exec("cat /mnt/v/a").stdout == "kept\n"
        assert client.volumes.resize(v, 64).size_mib == 64
        with pytest.raises(hutch.InvalidRequestError) as e:
            client.volumes.resize(v, 16)
        assert e.value.code == "volume_shrink_refused"
        with pytest.raises(hutch.InvalidRequestError) as e:
            client.sandboxes.create(volumes=[f"{name}:/etc"])
        assert e.value.code == "volume_path_invalid"
        with pytest.raises(ValueError):
            client.sandboxes.create(volumes=[f"{name}"])
    finally:
        client.volumes.delete(v)
    with pytest.raises(hutch.NotFoundError) as e:
        client.volumes.get(v.id)
    assert e.value.code == "volume_not_found"


async def test_async_volumes(aclient: hutch.AsyncHutch):
    name = f"sdk-{marker()}"
    v = await aclient.volumes.create(name, size_mib=16)
    try:
        assert v.id in [x.id for x in await aclient.volumes.list()]
        async with aclient.sandboxes.create(ttl="5m", volumes=[f"{name}:/workspace/v"]) as sb:
            assert (await sb.exec("touch /workspace/v/x && echo ok")).stdout == "ok\n"
            assert [h.sandbox_id for h in (await aclient.volumes.get(name)).mounted_by] == [sb.id]
        assert (await aclient.volumes.resize(name, 32)).size_mib == 32
    finally:
        await aclient.volumes.delete(v)
    with pytest.raises(hutch.NotFoundError):
        await aclient.volumes.get(name)
