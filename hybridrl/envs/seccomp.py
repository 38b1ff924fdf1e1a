"""A seccomp filter for the bwrap sandbox: the system calls tool code never needs and an escape would.

The filter is a classic BPF program (what `bwrap --seccomp FD` loads), assembled here so that no libseccomp is
needed. It refuses with EPERM: ptrace and the cross-process memory calls, mounting and namespace changes (unshare,
setns, clone with namespace flags), kernel modules, kexec, reboot, swap, clock and hostname changes, keyrings,
bpf, perf events, userfaultfd, io_uring, handle-based opens, and the x32 ABI; clone3 answers ENOSYS, so the C
library falls back to clone, whose flags the filter can read. A foreign architecture is killed. Only x86_64's
numbers are written down: elsewhere `program()` returns None and the sandbox runs without a filter (its
namespaces, dropped capabilities and unprivileged user still hold).
"""
from __future__ import annotations

import errno
import platform
import struct

# struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}; offsets into struct seccomp_data
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_NR, _ARCH, _ARG0_LOW = 0, 4, 16
_ALLOW, _ERRNO, _KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80

_X86_64_REFUSED = {
    "ptrace": 101, "syslog": 103, "personality": 135, "ustat": 136, "sysfs": 139, "uselib": 134, "vhangup": 153,
    "pivot_root": 155, "adjtimex": 159, "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165,
    "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171,
    "iopl": 172, "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179, "nfsservctl": 180,
    "lookup_dcookie": 212, "clock_settime": 227, "kexec_load": 246, "add_key": 248, "request_key": 249,
    "keyctl": 250, "unshare": 272, "perf_event_open": 298, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "clock_adjtime": 305, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "pidfd_getfd": 438, "mount_setattr": 442,
}
_X86_64_CLONE, _X86_64_CLONE3 = 56, 435


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program() -> bytes | None:
    """The filter for this machine's architecture, or None where its system-call numbers are not written down."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    refuse = _ERRNO | errno.EPERM
    ops = [_op(_LD_W_ABS, _ARCH), _op(_JEQ_K, _AUDIT_ARCH_X86_64, jt=1), _op(_RET_K, _KILL_PROCESS),
           _op(_LD_W_ABS, _NR), _op(_JGE_K, _X32_BIT, jf=1), _op(_RET_K, refuse)]
    for number in sorted(_X86_64_REFUSED.values()):
        ops += [_op(_JEQ_K, number, jf=1), _op(_RET_K, refuse)]
    ops += [_op(_JEQ_K, _X86_64_CLONE3, jf=1), _op(_RET_K, _ERRNO | errno.ENOSYS),
            # clone: refuse namespace flags (its first argument); every other clone (threads, fork) passes
            _op(_JEQ_K, _X86_64_CLONE, jf=3), _op(_LD_W_ABS, _ARG0_LOW), _op(_JSET_K, _NAMESPACE_FLAGS, jf=1),
            _op(_RET_K, refuse), _op(_RET_K, _ALLOW)]
    return b"".join(ops)
