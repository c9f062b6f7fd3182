//! The seccomp profile of a sandbox: reviewed data in
//! `policy/seccomp.json`, compiled here with `seccompiler` (a maintained
//! BPF compiler, the one Firecracker uses) into the filters the launch plan
//! installs right before the agent's exec (see `Step::Seccomp`). The agent
//! and everything it starts inherit them.
//!
//! The result is one program made of filters in order: first a fixed
//! architecture check (anything but the native ABI is killed, the x32 ABI
//! included, which seccompiler does not check and a deny list would let
//! through), then one seccompiler filter per action of the profile (EPERM,
//! ENOSYS), each answering its action for the calls it lists and going on
//! to the next for the rest; the last one allows them ([`chain`]). So a
//! call is refused if any filter refuses it, as if each were installed
//! apart, for one installation.
//!
//! Argument rules compare exactly the bits the kernel reads: a rule says
//! `bits: 32` where the kernel's argument is an `int`/`unsigned int` (or is
//! narrowed to one), and the comparison is then a 32-bit one (seccompiler's
//! `Dword`), so setting the upper half of the register changes nothing
//! (the bug class of CVE-2017-5226).

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use serde::Deserialize;
use std::collections::BTreeMap;

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
    #[error("seccomp profile names an unknown constant {0:?}")]
    UnknownConstant(String),
    #[error("seccomp rule for {0:?} is invalid: {1}")]
    BadRule(String, &'static str),
    #[error("seccomp profile compiles to {0} instructions, more than the kernel takes in one program")]
    TooLong(usize),
    #[error("seccomp filter for {action} does not compile: {source}")]
    Compile { action: String, source: seccompiler::BackendError },
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
    arg: Option<Arg>,
}

/// One condition on one argument.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Arg {
    /// 0 to 5.
    index: u8,
    /// The kernel's type of the argument and how it reads it, for the
    /// reviewer (`unsigned int cmd`, `long pid narrowed to pid_t`).
    #[allow(dead_code)]
    kernel: String,
    /// How many low bits of the argument the kernel uses: 32 or 64.
    bits: u32,
    /// The rule matches when the argument equals this.
    #[serde(default)]
    eq: Option<Value>,
    /// The rule matches when any of these bits is set.
    #[serde(default)]
    any_of: Option<Vec<Value>>,
}

/// A number, or the name of a constant (`CLONE_NEWUSER`, `TIOCSTI`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Value {
    Number(u64),
    Name(String),
}

impl Value {
    fn get(&self) -> Result<u64, SeccompError> {
        match self {
            Value::Number(n) => Ok(*n),
            Value::Name(name) => constant(name).ok_or_else(|| SeccompError::UnknownConstant(name.clone())),
        }
    }
}

/// The constants a profile may name.
fn constant(name: &str) -> Option<u64> {
    let v: u64 = match name {
        "CLONE_NEWNS" => libc::CLONE_NEWNS as u64,
        "CLONE_NEWCGROUP" => libc::CLONE_NEWCGROUP as u64,
        "CLONE_NEWUTS" => libc::CLONE_NEWUTS as u64,
        "CLONE_NEWIPC" => libc::CLONE_NEWIPC as u64,
        "CLONE_NEWUSER" => libc::CLONE_NEWUSER as u64,
        "CLONE_NEWPID" => libc::CLONE_NEWPID as u64,
        "CLONE_NEWNET" => libc::CLONE_NEWNET as u64,
        // Not in every libc release; the kernel's value (include/uapi/linux/sched.h).
        "CLONE_NEWTIME" => 0x80,
        "TIOCSTI" => libc::TIOCSTI,
        "TIOCLINUX" => libc::TIOCLINUX,
        _ => return None,
    };
    Some(v)
}

/// A BPF program of the profile: one of its filters, or all of them
/// chained ([`compile`]).
#[derive(Debug, Clone)]
pub struct Filter {
    /// What it does ("architecture check", "errno:EPERM", or those joined
    /// by ", then "), for error messages.
    pub name: String,
    pub program: BpfProgram,
}

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;
/// System call numbers at or above this are the x32 ABI on x86_64.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// The first filter: kill any call that is not of the native ABI (another
/// architecture, or x32 on x86_64, whose numbers carry bit 30 and so match
/// no rule of a deny list). Six fixed instructions, not a compiler.
// Classic BPF instructions, as `sock_filter::code`.
const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const JA: u16 = 0x05; // BPF_JMP | BPF_JA
const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
const RET_K: u16 = 0x06; // BPF_RET | BPF_K

fn arch_check() -> BpfProgram {
    const OFF_NR: u32 = 0; // struct seccomp_data
    const OFF_ARCH: u32 = 4;
    let i = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    vec![
        i(LD_W_ABS, 0, 0, OFF_ARCH),
        i(JEQ_K, 1, 0, AUDIT_ARCH),
        i(RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        i(LD_W_ABS, 0, 0, OFF_NR),
        i(JGE_K, 0, 1, X32_SYSCALL_BIT),
        i(RET_K, 0, 0, libc::SECCOMP_RET_KILL_PROCESS),
        i(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

fn target_arch() -> TargetArch {
    #[cfg(target_arch = "x86_64")]
    return TargetArch::x86_64;
    #[cfg(target_arch = "aarch64")]
    return TargetArch::aarch64;
}

/// Compiles a profile into the one program to install.
pub fn compile(profile: &str) -> Result<Filter, SeccompError> {
    chain(&compile_apart(profile)?)
}

/// The profile's filters, each a program of its own, in order.
fn compile_apart(profile: &str) -> Result<Vec<Filter>, SeccompError> {
    let profile: Profile = serde_json::from_str(profile)?;
    // action -> syscall -> rules (an empty list: the call is refused whatever its arguments).
    let mut by_action: BTreeMap<String, BTreeMap<i64, Option<Vec<SeccompRule>>>> = BTreeMap::new();
    let mut seen: BTreeMap<i64, (String, bool)> = BTreeMap::new();
    for rule in &profile.rules {
        parse_action(&rule.action)?;
        for name in &rule.syscalls {
            let nr = syscall_number(name).ok_or_else(|| SeccompError::UnknownSyscall(name.clone()))?;
            let conditional = rule.arg.is_some();
            // A call refused whatever its arguments, or listed under two
            // actions, is a reviewing mistake: say so rather than pick.
            if let Some((other, was_conditional)) = seen.get(&nr) {
                if *other != rule.action {
                    return Err(SeccompError::BadRule(name.clone(), "listed under two actions"));
                }
                if !conditional || !was_conditional {
                    return Err(SeccompError::BadRule(name.clone(), "listed twice, once without an argument rule"));
                }
            }
            seen.insert(nr, (rule.action.clone(), conditional));
            let entry = by_action.entry(rule.action.clone()).or_default().entry(nr).or_insert(Some(Vec::new()));
            match &rule.arg {
                None => *entry = None,
                Some(arg) => {
                    if let Some(rules) = entry {
                        rules.extend(arg_rules(name, arg)?);
                    }
                }
            }
        }
    }
    let mut filters = vec![Filter { name: "architecture check".into(), program: arch_check() }];
    for (action_name, calls) in by_action {
        let action = parse_action(&action_name)?;
        let rules: BTreeMap<i64, Vec<SeccompRule>> =
            calls.into_iter().map(|(nr, rules)| (nr, rules.unwrap_or_default())).collect();
        let compile_err = |source| SeccompError::Compile { action: action_name.clone(), source };
        let filter = SeccompFilter::new(rules, SeccompAction::Allow, action, target_arch()).map_err(compile_err)?;
        let program: BpfProgram = filter.try_into().map_err(compile_err)?;
        filters.push(Filter { name: action_name, program });
    }
    Ok(filters)
}

/// The filters as one program, in order, each one's "allow" going on to
/// the next one's first instruction.
///
/// Installed apart, each filter cost the kernel a compile and a pass of
/// its action cache over every system call number: 60, 33 and 155 µs for
/// the three (`perf trace` of `hutch run`), and every call the cache
/// cannot answer ran all three programs. The answers are the same: the
/// kernel applies the most severe of the filters' answers, the chain the
/// first refusal, and at most one filter refuses a call. The architecture
/// check comes first and its kill is the most severe answer there is; each
/// later filter refuses only the calls listed under its action, and a
/// call is listed under one action only (`compile` refuses a profile that
/// lists one under two).
fn chain(filters: &[Filter]) -> Result<Filter, SeccompError> {
    let mut program = Vec::new();
    for (i, f) in filters.iter().enumerate() {
        let last = i + 1 == filters.len();
        let len = f.program.len();
        program.extend(f.program.iter().enumerate().map(|(at, insn)| {
            if !last && insn.code == RET_K && insn.k == libc::SECCOMP_RET_ALLOW {
                // To the next filter, the instruction after this one's last.
                sock_filter { code: JA, jt: 0, jf: 0, k: (len - at - 1) as u32 }
            } else {
                insn.clone()
            }
        }));
    }
    if program.len() > BPF_MAXINSNS {
        return Err(SeccompError::TooLong(program.len()));
    }
    let name = filters.iter().map(|f| f.name.as_str()).collect::<Vec<_>>().join(", then ");
    Ok(Filter { name, program })
}

/// The most instructions the kernel takes in one program.
const BPF_MAXINSNS: usize = 4096;

/// The seccompiler rules of one argument condition; the call matches when
/// any of them does.
fn arg_rules(name: &str, arg: &Arg) -> Result<Vec<SeccompRule>, SeccompError> {
    let bad = |why| SeccompError::BadRule(name.to_owned(), why);
    if arg.index > 5 {
        return Err(bad("argument index above 5"));
    }
    let len = match arg.bits {
        32 => SeccompCmpArgLen::Dword,
        64 => SeccompCmpArgLen::Qword,
        _ => return Err(bad("bits must be 32 or 64")),
    };
    let fits = |v: u64| arg.bits == 64 || v <= u64::from(u32::MAX);
    let cond = |op, v| {
        SeccompCondition::new(arg.index, len.clone(), op, v)
            .and_then(|c| SeccompRule::new(vec![c]))
            .map_err(|source| SeccompError::Compile { action: name.to_owned(), source })
    };
    match (&arg.eq, &arg.any_of) {
        (Some(v), None) => {
            let v = v.get()?;
            if !fits(v) {
                return Err(bad("value wider than the argument"));
            }
            Ok(vec![cond(SeccompCmpOp::Eq, v)?])
        }
        (None, Some(flags)) => {
            if flags.is_empty() {
                return Err(bad("any_of lists no flag"));
            }
            // One rule per flag: (arg & flag) == flag. Flags are single bits.
            let mut rules = Vec::with_capacity(flags.len());
            for f in flags {
                let f = f.get()?;
                if f.count_ones() != 1 || !fits(f) {
                    return Err(bad("any_of takes single bits within the argument"));
                }
                rules.push(cond(SeccompCmpOp::MaskedEq(f), f)?);
            }
            Ok(rules)
        }
        _ => Err(bad("an argument rule has exactly one of eq and any_of")),
    }
}

fn parse_action(action: &str) -> Result<SeccompAction, SeccompError> {
    match action {
        "errno:EPERM" => Ok(SeccompAction::Errno(libc::EPERM as u32)),
        "errno:ENOSYS" => Ok(SeccompAction::Errno(libc::ENOSYS as u32)),
        other => Err(SeccompError::UnknownAction(other.to_owned())),
    }
}

// A lookup of the names the profile may use. `libc::SYS_*` holds the
// numbers for the build target.
fn syscall_number(name: &str) -> Option<i64> {
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
        "io_setup" => libc::SYS_io_setup,
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
    Some(nr)
}

#[cfg(test)]
mod tests {
    //! The compiled profile, tested against the kernel: a forked child
    //! installs the filters and makes each call; the parent reads what the
    //! kernel answered. Every argument rule is tried three ways: the call it
    //! refuses, the same call with the upper 32 bits of the argument set,
    //! and a call it allows. Arguments are chosen so that the kernel itself
    //! would answer something other than EPERM (EINVAL for impossible flag
    //! combinations, ESRCH for a process not traced, ENOTTY for a file that
    //! is no terminal), so an EPERM can only be the filter's.
    use super::*;

    const HIGH: u64 = 1 << 32;

    /// Raw result of one call: >= 0, or -errno; `KILLED` when the filter
    /// killed the process.
    const KILLED: i64 = i64::MIN;

    /// Installs the shipped profile in a fresh child, makes each call, and
    /// returns what each call returned.
    fn under_profile(calls: &[(i64, [u64; 6])]) -> Vec<i64> {
        let profile = compile(PROFILE).expect("the shipped profile compiles");
        let prog = libc::sock_fprog { len: profile.program.len() as u16, filter: profile.program.as_ptr() as *mut _ };
        let mut results = Vec::new();
        for call in calls {
            let (rd, wr) = crate::sys::pipe().expect("pipe");
            use std::os::fd::AsRawFd;
            let (rd_fd, wr_fd) = (rd.as_raw_fd(), wr.as_raw_fd());
            // SAFETY: the child makes only raw system calls on memory
            // prepared before the fork (progs, call) and exits; the test
            // harness's other threads are not touched.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork");
            if pid == 0 {
                // SAFETY: in the forked child: raw system calls only.
                unsafe {
                    crate::sys::raw::syscall(libc::SYS_prctl, [libc::PR_SET_NO_NEW_PRIVS as usize, 1, 0, 0, 0, 0]);
                    let r = crate::sys::raw::syscall(
                        libc::SYS_seccomp,
                        [libc::SECCOMP_SET_MODE_FILTER as usize, 0, &prog as *const _ as usize, 0, 0, 0],
                    );
                    if r < 0 {
                        crate::sys::raw::exit(3);
                    }
                    let (nr, a) = call;
                    let a = a.map(|x| x as usize);
                    let r = crate::sys::raw::syscall(*nr as libc::c_long, a) as i64;
                    let bytes = r.to_ne_bytes();
                    crate::sys::raw::syscall(libc::SYS_write, [wr_fd as usize, bytes.as_ptr() as usize, 8, 0, 0, 0]);
                    crate::sys::raw::exit(0);
                }
            }
            drop(wr);
            let mut buf = [0u8; 8];
            let n = crate::sys::read_full(rd_fd, &mut buf).expect("read");
            let status = crate::sys::reap(pid).expect("reap");
            if n == 8 {
                assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status:#x}");
                results.push(i64::from_ne_bytes(buf));
            } else {
                assert!(libc::WIFSIGNALED(status), "child neither answered nor was killed: {status:#x}");
                assert_eq!(libc::WTERMSIG(status), libc::SIGSYS, "killed by the filter");
                results.push(KILLED);
            }
        }
        results
    }

    fn e(errno: i32) -> i64 {
        -(errno as i64)
    }

    fn sc(nr: libc::c_long, args: &[u64]) -> (i64, [u64; 6]) {
        let mut a = [0u64; 6];
        a[..args.len()].copy_from_slice(args);
        (nr, a)
    }

    #[test]
    fn namespace_flags_are_refused_on_unshare_and_clone_with_or_without_high_bits() {
        let ns = [
            libc::CLONE_NEWNS,
            libc::CLONE_NEWCGROUP,
            libc::CLONE_NEWUTS,
            libc::CLONE_NEWIPC,
            libc::CLONE_NEWUSER,
            libc::CLONE_NEWPID,
            libc::CLONE_NEWNET,
            0x80, // CLONE_NEWTIME
        ];
        let mut calls = Vec::new();
        for f in ns {
            let f = f as u64;
            // Bit 0 is no unshare flag: the kernel alone would say EINVAL.
            calls.push(sc(libc::SYS_unshare, &[f | 1]));
            calls.push(sc(libc::SYS_unshare, &[f | 1 | HIGH]));
            // CLONE_SIGHAND without CLONE_VM: the kernel alone would say EINVAL.
            calls.push(sc(libc::SYS_clone, &[f | libc::CLONE_SIGHAND as u64]));
            calls.push(sc(libc::SYS_clone, &[f | libc::CLONE_SIGHAND as u64 | HIGH]));
        }
        for (i, r) in under_profile(&calls).into_iter().enumerate() {
            assert_eq!(r, e(libc::EPERM), "call {i}: {:?} passed the filter", calls[i]);
        }
        // What the rules allow reaches the kernel.
        let allowed = [
            sc(libc::SYS_unshare, &[libc::CLONE_FILES as u64]),
            sc(libc::SYS_unshare, &[1]),
            sc(libc::SYS_unshare, &[HIGH]),
            sc(libc::SYS_clone, &[libc::CLONE_SIGHAND as u64]),
            sc(libc::SYS_clone, &[libc::CLONE_SIGHAND as u64 | HIGH]),
        ];
        let got = under_profile(&allowed);
        assert_eq!(got, vec![0, e(libc::EINVAL), e(libc::EINVAL), e(libc::EINVAL), e(libc::EINVAL)]);
        // clone3 is refused whole, so that libc falls back to clone.
        assert_eq!(under_profile(&[sc(libc::SYS_clone3, &[0, 0])]), vec![e(libc::ENOSYS)]);
    }

    #[test]
    fn ptrace_of_pid_one_is_refused_with_or_without_high_bits() {
        const GETREGS: u64 = 12;
        let calls = [
            sc(libc::SYS_ptrace, &[GETREGS, 1]),
            sc(libc::SYS_ptrace, &[GETREGS, 1 | HIGH]),
            sc(libc::SYS_ptrace, &[GETREGS, 1 | 0xffff_ffff_0000_0000]),
            // Allowed: another pid reaches the kernel (not traced: ESRCH).
            sc(libc::SYS_ptrace, &[GETREGS, 2]),
        ];
        assert_eq!(under_profile(&calls), vec![e(libc::EPERM), e(libc::EPERM), e(libc::EPERM), e(libc::ESRCH)]);
    }

    #[test]
    fn tiocsti_and_tioclinux_are_refused_with_or_without_high_bits() {
        // fd 0 of the child is whatever the harness gave: not a terminal
        // under cargo test's capture; /dev/null's descriptor is opened here.
        let null = crate::sys::open("/dev/null", libc::O_RDWR).expect("open /dev/null");
        use std::os::fd::AsRawFd;
        let fd = null.as_raw_fd() as u64;
        let c = b"x".as_ptr() as u64;
        let calls = [
            sc(libc::SYS_ioctl, &[fd, libc::TIOCSTI, c]),
            sc(libc::SYS_ioctl, &[fd, libc::TIOCSTI | HIGH, c]),
            sc(libc::SYS_ioctl, &[fd, libc::TIOCLINUX, c]),
            sc(libc::SYS_ioctl, &[fd, libc::TIOCLINUX | HIGH, c]),
            // Allowed: other commands reach the kernel (no terminal: ENOTTY).
            sc(libc::SYS_ioctl, &[fd, libc::TIOCGWINSZ, c]),
            sc(libc::SYS_ioctl, &[fd, libc::TIOCSTI + 1, c]),
        ];
        assert_eq!(
            under_profile(&calls),
            vec![e(libc::EPERM), e(libc::EPERM), e(libc::EPERM), e(libc::EPERM), e(libc::ENOTTY), e(libc::ENOTTY)]
        );
    }

    #[test]
    fn listed_calls_are_refused_and_others_allowed() {
        let calls = [
            sc(libc::SYS_mount, &[0, 0, 0, 0, 0]),
            sc(libc::SYS_bpf, &[0, 0, 0]),
            sc(libc::SYS_setns, &[u64::MAX, 0]),
            sc(libc::SYS_io_uring_setup, &[1, 0]),
            sc(libc::SYS_io_setup, &[1, 0]),
            sc(libc::SYS_getpid, &[]),
        ];
        let got = under_profile(&calls);
        assert_eq!(&got[..5], &[e(libc::EPERM), e(libc::EPERM), e(libc::EPERM), e(libc::ENOSYS), e(libc::ENOSYS)]);
        assert!(got[5] > 0, "getpid: {}", got[5]);
    }

    /// What a classic BPF program answers for one `seccomp_data`: the
    /// instructions seccompiler and the architecture check use; any other
    /// fails the test.
    fn answer(program: &[sock_filter], data: &[u8; 64]) -> u32 {
        let word = |k: u32| u32::from_ne_bytes(data[k as usize..k as usize + 4].try_into().expect("a word"));
        let (mut a, mut x, mut mem) = (0u32, 0u32, [0u32; 16]);
        let mut pc = 0;
        loop {
            let i: &sock_filter = &program[pc];
            pc += 1;
            match i.code {
                0x20 => a = word(i.k),         // LD W ABS
                0x00 => a = i.k,               // LD IMM
                0x60 => a = mem[i.k as usize], // LD MEM
                0x01 => x = i.k,               // LDX IMM
                0x61 => x = mem[i.k as usize], // LDX MEM
                0x02 => mem[i.k as usize] = a, // ST
                0x03 => mem[i.k as usize] = x, // STX
                0x54 => a &= i.k,              // ALU AND K
                0x07 => x = a,                 // TAX
                0x87 => a = x,                 // TXA
                0x05 => pc += i.k as usize,    // JA
                0x15 | 0x25 | 0x35 | 0x45 => {
                    let taken = match i.code {
                        0x15 => a == i.k,
                        0x25 => a > i.k,
                        0x35 => a >= i.k,
                        _ => a & i.k != 0,
                    };
                    pc += usize::from(if taken { i.jt } else { i.jf });
                }
                0x06 => return i.k, // RET K
                0x16 => return a,   // RET A
                code => panic!("instruction {code:#x} is not interpreted here"),
            }
        }
    }

    /// The chained profile answers every call as its filters installed
    /// apart would: the kernel keeps the lowest action (as a signed
    /// number), the newest filter's among equals.
    #[test]
    fn the_chained_profile_answers_as_its_filters_apart() {
        let apart = compile_apart(PROFILE).expect("the profile compiles");
        assert!(apart.len() >= 3, "the architecture check and a filter per action");
        let chained = &compile(PROFILE).expect("the profile compiles").program;
        assert_eq!(chained.len(), apart.iter().map(|f| f.program.len()).sum::<usize>());
        let action = |ret: u32| (ret & libc::SECCOMP_RET_ACTION_FULL) as i32;
        let values = [
            0,
            1,
            u64::MAX,
            HIGH,
            libc::CLONE_NEWUSER as u64,
            libc::CLONE_NEWUSER as u64 | HIGH,
            libc::CLONE_NEWNS as u64 | libc::CLONE_NEWNET as u64,
            libc::TIOCSTI,
            libc::TIOCSTI | HIGH,
            libc::TIOCLINUX,
            1 << 31,
        ];
        let (mut refused, mut allowed) = (0, 0);
        for arch in [AUDIT_ARCH, 0x4000_0003] {
            for nr in (0..470u32).chain([X32_SYSCALL_BIT, X32_SYSCALL_BIT | 39]) {
                for (index, value) in std::iter::once((0, 0)).chain((0..6).flat_map(|i| values.map(|v| (i, v)))) {
                    let mut data = [0u8; 64];
                    data[..4].copy_from_slice(&nr.to_ne_bytes());
                    data[4..8].copy_from_slice(&arch.to_ne_bytes());
                    data[16 + 8 * index..24 + 8 * index].copy_from_slice(&value.to_ne_bytes());
                    let mut want = libc::SECCOMP_RET_ALLOW;
                    for f in apart.iter().rev() {
                        let ret = answer(&f.program, &data);
                        if action(ret) < action(want) {
                            want = ret;
                        }
                    }
                    let got = answer(chained, &data);
                    assert_eq!(got, want, "nr {nr:#x}, arch {arch:#x}, argument {index} = {value:#x}");
                    if got == libc::SECCOMP_RET_ALLOW {
                        allowed += 1;
                    } else {
                        refused += 1;
                    }
                }
            }
        }
        assert!(refused > 0 && allowed > 0, "refused {refused}, allowed {allowed}");
    }

    #[test]
    fn the_x32_abi_is_killed() {
        // getpid through the x32 numbering: killed before any rule (the
        // kernel runs seccomp before it looks the number up, so this holds
        // on kernels built without x32 too).
        let x32_getpid = (X32_SYSCALL_BIT as libc::c_long) | libc::SYS_getpid;
        assert_eq!(under_profile(&[sc(x32_getpid, &[])]), vec![KILLED]);
    }

    #[test]
    fn every_argument_rule_names_the_kernel_type_and_its_width() {
        let profile: Profile = serde_json::from_str(PROFILE).expect("parse");
        let mut args = 0;
        for rule in &profile.rules {
            if let Some(arg) = &rule.arg {
                args += 1;
                assert!(!arg.kernel.is_empty(), "{:?}: say which kernel type the argument has", rule.syscalls);
                // Every argument rule of ours reads an int-sized value.
                assert_eq!(arg.bits, 32, "{:?}", rule.syscalls);
            }
        }
        assert_eq!(args, 5);
    }

    #[test]
    fn unknown_names_actions_and_ambiguous_rules_are_refused() {
        let one = |rules: &str| format!(r#"{{"about":"","rules":[{rules}]}}"#);
        let bad = one(r#"{"why":"","action":"errno:EPERM","syscalls":["no_such_call"]}"#);
        assert!(matches!(compile(&bad), Err(SeccompError::UnknownSyscall(_))));
        let bad = one(r#"{"why":"","action":"trace","syscalls":["mount"]}"#);
        assert!(matches!(compile(&bad), Err(SeccompError::UnknownAction(_))));
        let bad = one(
            r#"{"why":"","action":"errno:EPERM","syscalls":["ioctl"],"arg":{"index":1,"kernel":"","bits":32,"eq":"TIOCNOPE"}}"#,
        );
        assert!(matches!(compile(&bad), Err(SeccompError::UnknownConstant(_))));
        let bad = one(
            r#"{"why":"","action":"errno:EPERM","syscalls":["ioctl"],"arg":{"index":1,"kernel":"","bits":32,"eq":4294967296}}"#,
        );
        assert!(matches!(compile(&bad), Err(SeccompError::BadRule(..))), "a value wider than 32 bits");
        let bad = one(
            r#"{"why":"","action":"errno:EPERM","syscalls":["ioctl"],"arg":{"index":1,"kernel":"","bits":16,"eq":1}}"#,
        );
        assert!(matches!(compile(&bad), Err(SeccompError::BadRule(..))));
        let bad = one(
            r#"{"why":"","action":"errno:EPERM","syscalls":["clone"],"arg":{"index":0,"kernel":"","bits":32,"any_of":[3]}}"#,
        );
        assert!(matches!(compile(&bad), Err(SeccompError::BadRule(..))), "a mask of two bits");
        let bad = one(
            r#"{"why":"","action":"errno:EPERM","syscalls":["mount"]},{"why":"","action":"errno:ENOSYS","syscalls":["mount"]}"#,
        );
        assert!(matches!(compile(&bad), Err(SeccompError::BadRule(..))), "two actions");
    }
}
