/* amx_refused: run a command as on a host that advertises AMX but refuses its tile state.
 *
 *   gcc -O2 -o amx_refused scripts/amx_refused.c && ./amx_refused CMD [ARGS...]
 *
 * Some of our CI machines report AMX in CPUID (torch.cpu._is_amx_tile_supported() is True)
 * but their kernel or hypervisor refuses arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA):
 * every AMX tile instruction then dies with SIGILL. This wrapper makes any AMX host behave
 * that way for CMD and everything it starts: a seccomp filter (inherited across fork and
 * exec, cannot be lifted) answers that arch_prctl with EPERM. Nothing else changes, so
 * vllm_hawk.cpu_amx's probe, torch._init_amx(), oneDNN and vLLM meet exactly the refusal
 * such a host gives them. `make test-amx-refused` runs the engine tests under it.
 */
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s CMD [ARGS...]\n", argv[0]);
        return 2;
    }
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 0, 5),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_arch_prctl, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, ARCH_REQ_XCOMP_PERM, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof(filter) / sizeof(filter[0]), .filter = filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
        fprintf(stderr, "amx_refused: cannot install the seccomp filter: %s\n", strerror(errno));
        return 2;
    }
    execvp(argv[1], argv + 1);
    fprintf(stderr, "amx_refused: cannot run %s: %s\n", argv[1], strerror(errno));
    return 127;
}
