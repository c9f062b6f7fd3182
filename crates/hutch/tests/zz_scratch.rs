mod common;
use common::*;
use hutch_runtime::cgroup::Limits;
use hutch_runtime::{ProcessSpec, SandboxSpec};
use std::time::Instant;
#[test]
fn scratch_timing() {
    let env = Env::new("proc-scratch");
    let rt = runtime(&env);
    let spec = SandboxSpec { limits: Limits { memory_bytes: 1 << 30, pids: 4096, cpu_millis: 2000 }, disk_bytes: 256 << 20, ..SandboxSpec::default() };
    let host = Guard(Some(rt.start_host(&spec).unwrap()));
    let mut c = Vec::new(); let mut d = Vec::new(); let mut cg = Vec::new();
    for i in 0..200 {
        let t0 = Instant::now();
        let t = rt.start_tenant(&host, &ProcessSpec { id: Some(format!("s{i}")), limits: Limits { memory_bytes: 128 << 20, pids: 64, cpu_millis: 1000 }, env: vec![] }).unwrap();
        c.push(t0.elapsed().as_micros()); cg.push(t.timings[0].1.as_micros());
        let t1 = Instant::now();
        t.destroy().unwrap();
        d.push(t1.elapsed().as_micros());
    }
    c.sort(); d.sort(); cg.sort();
    eprintln!("create p50 {} p90 {} | cgroup p50 {} | destroy p50 {} p90 {}", c[100], c[180], cg[100], d[100], d[180]);
}
