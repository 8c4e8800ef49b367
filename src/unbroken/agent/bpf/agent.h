/* Layouts shared by the agent's BPF programs and their Python reader (agent/maps.py mirrors
 * these with ctypes; a test checks the sizes). Nothing else defines them. */
#ifndef UNBROKEN_AGENT_H
#define UNBROKEN_AGENT_H

#define MAX_SLOTS 40 /* log2 buckets of nanoseconds: [2^i, 2^(i+1)) for i < MAX_SLOTS */

struct start_val {
    __u64 ts;
    __u32 fn;
    __u32 depth; /* traced calls nested inside this one (a runtime call's driver call) */
};

struct call_key {
    __u32 pid;
    __u32 fn;
};

/* Everything about one (pid, function): one map lookup per call. */
struct call_hist {
    __u64 count;
    __u64 sum_ns;
    __u64 slots[MAX_SLOTS];
};

/* One socket a traced process has sent on, keyed by its struct sock address. The kernel's own
 * chrono (tcp_sock.chrono_stat, what tcp_info's tcpi_rwnd_limited / tcpi_sndbuf_limited
 * report) is read in jiffies; `base_*` is its value when the agent first saw the socket (or
 * when another process took it over), so time before that is not credited. The `collect`
 * program refreshes rwnd/sndbuf/permille of every open socket at scrape time. */
struct sock_state {
    __u32 pid;
    __u32 permille;    /* sk_wmem_queued / sk_sndbuf x1000 at the last collect, <= 1000 */
    __u32 base_rwnd;   /* chrono jiffies at first sight */
    __u32 base_sndbuf;
    __u32 rwnd;        /* jiffies receive-window limited since base (live at collect) */
    __u32 sndbuf;      /* jiffies send-buffer limited since base */
};

/* Per process: what its closed (or handed-over) sockets accrued; open ones are in socks. */
struct tcp_stats {
    __u64 sends;
    __u64 closed_rwnd;   /* jiffies */
    __u64 closed_sndbuf; /* jiffies */
    __u64 peak_permille; /* highest fill seen at a send or a collect, <= 1000 */
};

/* Written by `collect`: the kernel's HZ (CONFIG_HZ, 0 when libbpf found no kernel config),
 * and jiffies and ktime read together, for the reader to measure HZ when the config is absent. */
struct tcp_clock {
    __u64 hz;
    __u64 jiffies;
    __u64 ktime_ns;
};

#endif
