//! Children that share their parent's memory (`clone` with `CLONE_VM`):
//! a stack of their own with a guard page below it, and the clone. The one
//! implementation used on both sides of the link: by the agent to start a
//! command, and by hutch-runtime to start a sandbox and its namespace
//! helper.
//!
//! Such a child copies no page tables and, on virtual machines where page
//! faults are costly, makes neither side take copy-on-write faults
//! afterwards. It runs on memory it shares with its parent, so it must only
//! make system calls and write nothing but its own stack; a stack overflow
//! hits the guard page (SIGSEGV in the child) instead of silently
//! overwriting whatever the parent mapped below the stack.

use std::io;

/// An anonymous mapping for a child's stack, its lowest page inaccessible.
#[derive(Debug)]
pub struct VmStack {
    base: *mut libc::c_void,
    len: usize,
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory effects.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

impl VmStack {
    /// A stack of at least `usable` bytes above one guard page.
    pub fn new(usable: usize) -> io::Result<VmStack> {
        let page = page_size();
        let len = usable.div_ceil(page) * page + page;
        // SAFETY: a fresh anonymous private mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = VmStack { base, len };
        // SAFETY: the lowest page of our own mapping becomes the guard page.
        if unsafe { libc::mprotect(base, page, libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// Where the child's stack pointer starts: the top, 16-byte aligned
    /// with some room, as stacks grow down.
    pub fn top(&self) -> *mut libc::c_void {
        ((self.base as usize + self.len - 64) & !15) as *mut libc::c_void
    }

    /// The guard page's address range (for tests).
    pub fn guard(&self) -> std::ops::Range<usize> {
        self.base as usize..self.base as usize + page_size()
    }
}

impl Drop for VmStack {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; callers drop a VmStack only
        // when no child runs on it any more.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

/// `clone(f, stack, flags | CLONE_VM, arg)`: starts `f(arg)` in a child on
/// `stack`. With `CLONE_VFORK` in `flags` this returns once the child has
/// exec'd or exited; without it, both run at once.
///
/// # Safety
/// `f` must only make system calls (without `errno`, unless the caller is
/// suspended by `CLONE_VFORK`: the child shares the calling thread's TLS),
/// write nothing but its own stack and end in `execve` or an exit; `stack`
/// and everything `arg` points to must outlive the child's use of them.
pub unsafe fn clone_vm(
    f: extern "C" fn(*mut libc::c_void) -> libc::c_int,
    stack: &VmStack,
    flags: libc::c_int,
    arg: *mut libc::c_void,
) -> io::Result<libc::pid_t> {
    // SAFETY: guaranteed by the caller, see above.
    let pid = unsafe { libc::clone(f, stack.top(), flags | libc::CLONE_VM, arg) };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lowest_page_is_a_guard_and_the_top_is_aligned() {
        let s = VmStack::new(10_000).expect("stack");
        assert_eq!(s.top() as usize % 16, 0);
        assert!(s.top() as usize > s.guard().end + 10_000 - 64);
        // The guard page is mapped PROT_NONE: /proc/self/maps shows it.
        let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
        let line = maps
            .lines()
            .find(|l| l.starts_with(&format!("{:x}-", s.guard().start)))
            .expect("the guard page is its own mapping");
        assert!(line.split_whitespace().nth(1) == Some("---p"), "{line}");
    }

    #[test]
    fn a_child_runs_on_it_and_is_waited_for() {
        extern "C" fn child(arg: *mut libc::c_void) -> libc::c_int {
            // Writes only its parent's local through the pointer it was
            // given (the parent is suspended: CLONE_VFORK).
            // SAFETY: arg points at the parent's `flag`, alive until clone returns.
            unsafe { *(arg as *mut u32) = 7 };
            0
        }
        let s = VmStack::new(16 * 1024).expect("stack");
        let mut flag = 0u32;
        // SAFETY: the child writes one u32 the parent owns and exits.
        let pid = unsafe {
            clone_vm(child, &s, libc::CLONE_VFORK | libc::SIGCHLD, &mut flag as *mut u32 as *mut libc::c_void)
        }
        .expect("clone");
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert_eq!(flag, 7);
    }
}
