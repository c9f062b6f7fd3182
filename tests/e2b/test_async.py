"""The async SDK for a few flows."""

from e2b import AsyncSandbox


async def test_async_create_run_files_kill(daemon):
    sb = await AsyncSandbox.create(metadata={"flavor": "async"})
    try:
        out = []
        r = await sb.commands.run("echo async; echo $HOME", on_stdout=out.append)
        assert r.stdout == "async\n/home/user\n" and "".join(out) == r.stdout
        await sb.files.write("a.txt", "from async")
        assert await sb.files.read("a.txt") == "from async"
        h = await sb.commands.run("sleep 60", background=True)
        assert await h.kill()
    finally:
        await sb.kill()
    assert not await sb.is_running()
