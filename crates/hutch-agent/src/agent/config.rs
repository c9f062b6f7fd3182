//! The start-up configuration the host writes to descriptor 4: one protocol
//! frame whose header is an [`AgentConfig`] and whose data is the seccomp
//! filter every workload installs before exec.

use hutch_agent::proto::{self, AgentConfig};

use super::env;

/// Longest classic-BPF program the kernel accepts (BPF_MAXINSNS).
const MAX_BPF_INSNS: usize = 4096;
/// Replay buffers are capped well below a connection's hard output cap, so
/// that replaying them can never get a connection dropped.
const MAX_REPLAY: usize = 16 * 1024 * 1024;

/// What the agent runs with, validated.
pub struct Config {
    /// Sandbox-wide environment; invalid entries are left out.
    pub env: Vec<(String, String)>,
    pub root_caps: u64,
    pub replay_bytes: usize,
    /// Most live command trees (see `AgentConfig::max_commands`).
    pub max_commands: usize,
    pub filter: Vec<libc::sock_filter>,
    /// Descriptors of the workload cgroup's `cgroup.procs` files, from
    /// `proto::WORK_CGROUP_FD` on.
    pub work_cgroups: u32,
    /// Whether the descriptor after those is the workload cgroup's OOM counter.
    pub oom_events: bool,
    /// Whether the descriptor after those is the delegated directory of
    /// command cgroups (see `AgentConfig::tree_cgroup`).
    pub tree_cgroup: bool,
}

/// Parses the bytes read from descriptor 4: exactly one frame.
pub fn parse(bytes: &[u8]) -> Result<Config, String> {
    let frame = proto::split_frame(bytes).map_err(|e| e.to_string())?.ok_or("config frame is incomplete")?;
    if frame.consumed != bytes.len() {
        return Err("trailing bytes after the config frame".into());
    }
    let cfg: AgentConfig = proto::parse_header(frame.header).map_err(|e| e.to_string())?;
    if cfg.version != proto::PROTOCOL_VERSION {
        return Err(format!("config for protocol {}, agent speaks {}", cfg.version, proto::PROTOCOL_VERSION));
    }
    let data = frame.data;
    if data.len() % 8 != 0 || data.len() / 8 > MAX_BPF_INSNS {
        return Err(format!("seccomp program of {} bytes is malformed", data.len()));
    }
    let filter = data
        .chunks_exact(8)
        .map(|c| libc::sock_filter {
            code: u16::from_ne_bytes([c[0], c[1]]),
            jt: c[2],
            jf: c[3],
            k: u32::from_ne_bytes([c[4], c[5], c[6], c[7]]),
        })
        .collect();
    if cfg.work_cgroups > proto::MAX_WORK_CGROUPS {
        return Err(format!("{} workload cgroups; at most {}", cfg.work_cgroups, proto::MAX_WORK_CGROUPS));
    }
    let env = cfg.env.into_iter().filter(|(k, v)| env::check_var(k, v).is_ok()).collect();
    Ok(Config {
        env,
        root_caps: cfg.root_caps,
        replay_bytes: (cfg.replay_bytes as usize).min(MAX_REPLAY),
        max_commands: (cfg.max_commands as usize).clamp(1, super::server::MAX_PROCS),
        filter,
        work_cgroups: cfg.work_cgroups,
        oom_events: cfg.oom_events,
        tree_cgroup: cfg.tree_cgroup,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(cfg: &AgentConfig, bpf: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        proto::encode(cfg, bpf, &mut out).expect("encode");
        out
    }

    fn sample() -> AgentConfig {
        AgentConfig {
            version: proto::PROTOCOL_VERSION,
            env: vec![("A".into(), "1".into()), ("B=C".into(), "2".into())],
            root_caps: 5,
            replay_bytes: 1024,
            max_commands: 64,
            work_cgroups: 2,
            oom_events: true,
            tree_cgroup: false,
        }
    }

    #[test]
    fn config_frame_parses_filter_and_drops_bad_env() {
        let bpf = [6u8, 0, 0, 0, 0, 0, 0xff, 0x7f];
        let cfg = parse(&frame(&sample(), &bpf)).expect("valid");
        assert_eq!(cfg.env, vec![("A".to_string(), "1".to_string())]);
        assert_eq!(cfg.filter.len(), 1);
        assert_eq!(cfg.filter[0].code, 6);
        assert_eq!(cfg.filter[0].k, 0x7fff_0000);
        assert_eq!(cfg.replay_bytes, 1024);
    }

    #[test]
    fn config_with_ragged_filter_or_trailing_bytes_is_refused() {
        assert!(parse(&frame(&sample(), &[0u8; 7])).is_err());
        let mut bytes = frame(&sample(), &[]);
        bytes.push(0);
        assert!(parse(&bytes).is_err());
        assert!(parse(&[]).is_err());
        let too_many = AgentConfig { work_cgroups: proto::MAX_WORK_CGROUPS + 1, ..sample() };
        assert!(parse(&frame(&too_many, &[])).is_err());
    }
}
