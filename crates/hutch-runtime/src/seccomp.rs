//! The seccomp profile of workload processes: reviewed data in
//! `policy/seccomp.json`, compiled here into a classic BPF program.
//!
//! The compiler is small on purpose so that it can be read in one sitting:
//! check the architecture (anything but the native one is killed), refuse
//! the x32 ABI, then one block per rule that compares the syscall number and
//! at most one argument, and a final allow. The agent installs the program in
//! every workload process after `no_new_privs`, right before `execve`.

use serde::Deserialize;

/// The profile shipped with hutch.
pub const PROFILE: &str = include_str!("../policy/seccomp.json");

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("seccomp profile is malformed: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("seccomp profile names an unknown system call {0:?}")]
    UnknownSyscall(String),
    #[error("seccomp profile has an unknown action {0:?}")]
    UnknownAction(String),
    #[error("seccomp rule for {0:?} is invalid: {1}")]
    BadRule(String, &'static str),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Profile {
    #[allow(dead_code)]
    about: String,
    rules: Vec<Rule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    #[allow(dead_code)]
    why: String,
    action: String,
    syscalls: Vec<String>,
    #[serde(default)]
    arg_mask_any: Option<ArgMask>,
    #[serde(default)]
    arg_eq: Option<ArgEq>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ArgMask {
    index: u32,
    mask: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ArgEq {
    index: u32,
    value: u64,
}

// Classic BPF opcodes (linux/filter.h, linux/bpf_common.h).
/// BPF_LD | BPF_W | BPF_ABS
const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JMP_JEQ_K: u16 = 0x05 | 0x10;
const BPF_JMP_JGE_K: u16 = 0x05 | 0x30;
const BPF_JMP_JSET_K: u16 = 0x05 | 0x40;
const BPF_RET_K: u16 = 0x06;

const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;

// Offsets into struct seccomp_data.
const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
const OFF_ARGS: u32 = 16;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;
/// System call numbers at or above this are the x32 ABI on x86_64.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// One classic BPF instruction, as `struct sock_filter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Insn {
    pub code: u16,
    pub jt: u8,
    pub jf: u8,
    pub k: u32,
}

const fn stmt(code: u16, k: u32) -> Insn {
    Insn { code, jt: 0, jf: 0, k }
}

const fn jump(code: u16, k: u32, jt: u8, jf: u8) -> Insn {
    Insn { code, jt, jf, k }
}

/// Compiles a profile into a BPF program.
pub fn compile(profile: &str) -> Result<Vec<Insn>, SeccompError> {
    let profile: Profile = serde_json::from_str(profile)?;
    let mut prog = vec![
        stmt(BPF_LD_W_ABS, OFF_ARCH),
        jump(BPF_JMP_JEQ_K, AUDIT_ARCH, 1, 0),
        stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, OFF_NR),
        jump(BPF_JMP_JGE_K, X32_SYSCALL_BIT, 0, 1),
        stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
    ];
    for rule in &profile.rules {
        let action = parse_action(&rule.action)?;
        for name in &rule.syscalls {
            let nr = syscall_number(name).ok_or_else(|| SeccompError::UnknownSyscall(name.clone()))?;
            let cond = condition(name, rule)?;
            // Block: [ld nr] jeq nr ? next : skip; cond...; ret action.
            let mut block = vec![stmt(BPF_LD_W_ABS, OFF_NR)];
            let body_len = cond.len() as u8 + 1;
            block.push(jump(BPF_JMP_JEQ_K, nr, 0, body_len));
            block.extend(cond);
            block.push(stmt(BPF_RET_K, action));
            prog.extend(block);
        }
    }
    prog.push(stmt(BPF_RET_K, SECCOMP_RET_ALLOW));
    Ok(prog)
}

/// Instructions that fall through to the rule's `ret` when its argument
/// condition holds and jump past it otherwise.
fn condition(name: &str, rule: &Rule) -> Result<Vec<Insn>, SeccompError> {
    match (&rule.arg_mask_any, &rule.arg_eq) {
        (None, None) => Ok(Vec::new()),
        (Some(_), Some(_)) => Err(SeccompError::BadRule(name.to_owned(), "at most one argument condition")),
        (Some(m), None) => {
            let off = arg_offset(name, m.index)?;
            // Low word only: every flag we test lives there.
            Ok(vec![stmt(BPF_LD_W_ABS, off), jump(BPF_JMP_JSET_K, m.mask, 0, 1)])
        }
        (None, Some(e)) => {
            let off = arg_offset(name, e.index)?;
            Ok(vec![
                stmt(BPF_LD_W_ABS, off),
                jump(BPF_JMP_JEQ_K, e.value as u32, 0, 3),
                stmt(BPF_LD_W_ABS, off + 4),
                jump(BPF_JMP_JEQ_K, (e.value >> 32) as u32, 0, 1),
            ])
        }
    }
}

fn arg_offset(name: &str, index: u32) -> Result<u32, SeccompError> {
    if index > 5 {
        return Err(SeccompError::BadRule(name.to_owned(), "argument index above 5"));
    }
    Ok(OFF_ARGS + 8 * index)
}

fn parse_action(action: &str) -> Result<u32, SeccompError> {
    match action {
        "kill" => Ok(SECCOMP_RET_KILL_PROCESS),
        "errno:EPERM" => Ok(SECCOMP_RET_ERRNO | libc::EPERM as u32),
        "errno:ENOSYS" => Ok(SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        other => Err(SeccompError::UnknownAction(other.to_owned())),
    }
}

/// The program as the bytes of a `struct sock_filter` array.
pub fn to_bytes(prog: &[Insn]) -> Vec<u8> {
    let mut out = Vec::with_capacity(prog.len() * 8);
    for i in prog {
        out.extend_from_slice(&i.code.to_ne_bytes());
        out.push(i.jt);
        out.push(i.jf);
        out.extend_from_slice(&i.k.to_ne_bytes());
    }
    out
}

// A lookup of the names the profile may use. `libc::SYS_*` holds the
// numbers for the build target.
fn syscall_number(name: &str) -> Option<u32> {
    let nr: libc::c_long = match name {
        "mount" => libc::SYS_mount,
        "umount2" => libc::SYS_umount2,
        "pivot_root" => libc::SYS_pivot_root,
        "move_mount" => libc::SYS_move_mount,
        "open_tree" => libc::SYS_open_tree,
        "fsopen" => libc::SYS_fsopen,
        "fsconfig" => libc::SYS_fsconfig,
        "fsmount" => libc::SYS_fsmount,
        "fspick" => libc::SYS_fspick,
        "mount_setattr" => libc::SYS_mount_setattr,
        "kexec_load" => libc::SYS_kexec_load,
        "kexec_file_load" => libc::SYS_kexec_file_load,
        "reboot" => libc::SYS_reboot,
        "init_module" => libc::SYS_init_module,
        "finit_module" => libc::SYS_finit_module,
        "delete_module" => libc::SYS_delete_module,
        "bpf" => libc::SYS_bpf,
        "keyctl" => libc::SYS_keyctl,
        "add_key" => libc::SYS_add_key,
        "request_key" => libc::SYS_request_key,
        "perf_event_open" => libc::SYS_perf_event_open,
        "userfaultfd" => libc::SYS_userfaultfd,
        "io_uring_setup" => libc::SYS_io_uring_setup,
        "io_uring_enter" => libc::SYS_io_uring_enter,
        "io_uring_register" => libc::SYS_io_uring_register,
        "open_by_handle_at" => libc::SYS_open_by_handle_at,
        "name_to_handle_at" => libc::SYS_name_to_handle_at,
        "swapon" => libc::SYS_swapon,
        "swapoff" => libc::SYS_swapoff,
        "settimeofday" => libc::SYS_settimeofday,
        "clock_settime" => libc::SYS_clock_settime,
        "clock_adjtime" => libc::SYS_clock_adjtime,
        "adjtimex" => libc::SYS_adjtimex,
        "acct" => libc::SYS_acct,
        "quotactl" => libc::SYS_quotactl,
        "quotactl_fd" => libc::SYS_quotactl_fd,
        "syslog" => libc::SYS_syslog,
        #[cfg(target_arch = "x86_64")]
        "iopl" => libc::SYS_iopl,
        #[cfg(target_arch = "x86_64")]
        "ioperm" => libc::SYS_ioperm,
        "vhangup" => libc::SYS_vhangup,
        "lookup_dcookie" => libc::SYS_lookup_dcookie,
        #[cfg(target_arch = "x86_64")]
        "uselib" => libc::SYS_uselib,
        "setns" => libc::SYS_setns,
        "unshare" => libc::SYS_unshare,
        "clone" => libc::SYS_clone,
        "clone3" => libc::SYS_clone3,
        "ptrace" => libc::SYS_ptrace,
        "ioctl" => libc::SYS_ioctl,
        _ => return None,
    };
    Some(nr as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the program the way the kernel would, on one system call.
    fn eval(prog: &[Insn], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = Vec::new();
        data.extend_from_slice(&nr.to_ne_bytes());
        data.extend_from_slice(&arch.to_ne_bytes());
        data.extend_from_slice(&0u64.to_ne_bytes());
        for a in args {
            data.extend_from_slice(&a.to_ne_bytes());
        }
        let mut acc = 0u32;
        let mut pc = 0usize;
        loop {
            let i = prog[pc];
            match i.code {
                BPF_LD_W_ABS => {
                    let k = i.k as usize;
                    acc = u32::from_ne_bytes(data[k..k + 4].try_into().expect("4 bytes"));
                }
                BPF_JMP_JEQ_K | BPF_JMP_JGE_K | BPF_JMP_JSET_K => {
                    let taken = match i.code {
                        BPF_JMP_JEQ_K => acc == i.k,
                        BPF_JMP_JGE_K => acc >= i.k,
                        _ => acc & i.k != 0,
                    };
                    pc += if taken { i.jt as usize } else { i.jf as usize };
                }
                BPF_RET_K => return i.k,
                other => panic!("unexpected opcode {other:#x}"),
            }
            pc += 1;
        }
    }

    fn prog() -> Vec<Insn> {
        compile(PROFILE).expect("shipped profile compiles")
    }

    const EPERM: u32 = SECCOMP_RET_ERRNO | libc::EPERM as u32;

    #[test]
    fn denies_what_the_profile_lists() {
        let p = prog();
        for nr in [libc::SYS_mount, libc::SYS_bpf, libc::SYS_kexec_load, libc::SYS_init_module, libc::SYS_setns] {
            assert_eq!(eval(&p, AUDIT_ARCH, nr as u32, [0; 6]), EPERM, "syscall {nr}");
        }
        assert_eq!(eval(&p, AUDIT_ARCH, libc::SYS_clone3 as u32, [0; 6]), SECCOMP_RET_ERRNO | libc::ENOSYS as u32);
    }

    #[test]
    fn allows_ordinary_calls() {
        let p = prog();
        for nr in [libc::SYS_read, libc::SYS_write, libc::SYS_openat, libc::SYS_execve, libc::SYS_getpid] {
            assert_eq!(eval(&p, AUDIT_ARCH, nr as u32, [0; 6]), SECCOMP_RET_ALLOW, "syscall {nr}");
        }
    }

    #[test]
    fn clone_is_denied_only_with_namespace_flags() {
        let p = prog();
        let clone = libc::SYS_clone as u32;
        let thread_flags = (libc::CLONE_VM | libc::CLONE_FS | libc::CLONE_FILES | libc::CLONE_THREAD) as u64;
        assert_eq!(eval(&p, AUDIT_ARCH, clone, [thread_flags, 0, 0, 0, 0, 0]), SECCOMP_RET_ALLOW);
        assert_eq!(eval(&p, AUDIT_ARCH, clone, [libc::SIGCHLD as u64, 0, 0, 0, 0, 0]), SECCOMP_RET_ALLOW);
        assert_eq!(eval(&p, AUDIT_ARCH, clone, [libc::CLONE_NEWUSER as u64, 0, 0, 0, 0, 0]), EPERM);
        let unshare = libc::SYS_unshare as u32;
        assert_eq!(eval(&p, AUDIT_ARCH, unshare, [libc::CLONE_NEWNET as u64, 0, 0, 0, 0, 0]), EPERM);
        assert_eq!(eval(&p, AUDIT_ARCH, unshare, [libc::CLONE_FILES as u64, 0, 0, 0, 0, 0]), SECCOMP_RET_ALLOW);
    }

    #[test]
    fn ptrace_of_pid_one_only_is_denied() {
        let p = prog();
        let ptrace = libc::SYS_ptrace as u32;
        assert_eq!(eval(&p, AUDIT_ARCH, ptrace, [16, 1, 0, 0, 0, 0]), EPERM);
        assert_eq!(eval(&p, AUDIT_ARCH, ptrace, [16, 42, 0, 0, 0, 0]), SECCOMP_RET_ALLOW);
        assert_eq!(eval(&p, AUDIT_ARCH, ptrace, [16, 1 | (1 << 32), 0, 0, 0, 0]), SECCOMP_RET_ALLOW);
    }

    #[test]
    fn tiocsti_is_denied() {
        let p = prog();
        assert_eq!(eval(&p, AUDIT_ARCH, libc::SYS_ioctl as u32, [0, libc::TIOCSTI, 0, 0, 0, 0]), EPERM);
        assert_eq!(eval(&p, AUDIT_ARCH, libc::SYS_ioctl as u32, [0, libc::TIOCGWINSZ, 0, 0, 0, 0]), SECCOMP_RET_ALLOW);
    }

    #[test]
    fn foreign_architectures_and_x32_are_killed() {
        let p = prog();
        assert_eq!(eval(&p, 0x4000_0003, libc::SYS_getpid as u32, [0; 6]), SECCOMP_RET_KILL_PROCESS);
        assert_eq!(eval(&p, AUDIT_ARCH, X32_SYSCALL_BIT | 39, [0; 6]), SECCOMP_RET_KILL_PROCESS);
    }

    #[test]
    fn unknown_names_and_actions_are_refused() {
        let bad = r#"{"about":"","rules":[{"why":"","action":"errno:EPERM","syscalls":["no_such_call"]}]}"#;
        assert!(matches!(compile(bad), Err(SeccompError::UnknownSyscall(_))));
        let bad = r#"{"about":"","rules":[{"why":"","action":"trace","syscalls":["mount"]}]}"#;
        assert!(matches!(compile(bad), Err(SeccompError::UnknownAction(_))));
    }
}
