/* faultshim: an LD_PRELOAD library that fails reads of chosen byte ranges of one file.
 *
 * storaged reads pack objects with os.preadv (which calls preadv2 or preadv; pread for the
 * header and index). This library interposes the pread/preadv family and, for the one file
 * named by FAULTSHIM_PATH (compared with the target of /proc/self/fd/N), injects:
 *
 *   FAULTSHIM_EIO=a-b,c-d      a read overlapping [a, b) fails with EIO, as a bad sector does
 *   FAULTSHIM_SHORT=a-b,...    a read overlapping [a, b) returns only the bytes before a (0 when it
 *                              starts at or after a), as if the file ended at a: a short read
 *   FAULTSHIM_LOG=path         one line per injected fault ("eio OFFSET LENGTH" or
 *                              "short OFFSET LENGTH RETURNED"), appended
 *
 * Offsets are decimal bytes. Without FAULTSHIM_PATH every call goes straight to libc.
 * Build: cc -shared -fPIC -O2 -o faultshim.so faultshim.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_RANGES 64

struct range {
    long long start, end;
};

static struct range eio_ranges[MAX_RANGES], short_ranges[MAX_RANGES];
static int eio_count, short_count;
static char target[PATH_MAX];
static const char *log_path;

static void parse_ranges(const char *spec, struct range *out, int *count) {
    while (spec && *spec && *count < MAX_RANGES) {
        char *end;
        long long start = strtoll(spec, &end, 10);
        if (*end != '-')
            return;
        long long stop = strtoll(end + 1, &end, 10);
        out[(*count)++] = (struct range){start, stop};
        spec = *end == ',' ? end + 1 : NULL;
    }
}

__attribute__((constructor)) static void faultshim_init(void) {
    const char *path = getenv("FAULTSHIM_PATH");
    if (!path || strlen(path) >= sizeof target)
        return;
    strcpy(target, path);
    parse_ranges(getenv("FAULTSHIM_EIO"), eio_ranges, &eio_count);
    parse_ranges(getenv("FAULTSHIM_SHORT"), short_ranges, &short_count);
    log_path = getenv("FAULTSHIM_LOG");
}

static int is_target(int fd) {
    char link[64], resolved[PATH_MAX];
    int saved = errno;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, resolved, sizeof resolved - 1);
    errno = saved;
    if (n < 0)
        return 0;
    resolved[n] = '\0';
    return strcmp(resolved, target) == 0;
}

static void log_fault(const char *what, long long offset, size_t length, long long returned) {
    if (!log_path)
        return;
    int saved = errno;
    char line[128];
    int n = returned < 0 ? snprintf(line, sizeof line, "%s %lld %zu\n", what, offset, length)
                         : snprintf(line, sizeof line, "%s %lld %zu %lld\n", what, offset, length, returned);
    int fd = open(log_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) {
        ssize_t ignored = write(fd, line, (size_t)n);
        (void)ignored;
        close(fd);
    }
    errno = saved;
}

enum { PASS = -2, FAIL_EIO = -1 };

/* PASS, FAIL_EIO, or how many bytes the read may return (a short read). */
static long long decide(int fd, long long offset, size_t length) {
    if (!target[0] || (!eio_count && !short_count) || !is_target(fd))
        return PASS;
    long long end = offset + (long long)length;
    for (int i = 0; i < eio_count; i++)
        if (offset < eio_ranges[i].end && end > eio_ranges[i].start)
            return FAIL_EIO;
    for (int i = 0; i < short_count; i++)
        if (offset < short_ranges[i].end && end > short_ranges[i].start)
            return short_ranges[i].start > offset ? short_ranges[i].start - offset : 0;
    return PASS;
}

static size_t iov_total(const struct iovec *iov, int count) {
    size_t total = 0;
    for (int i = 0; i < count; i++)
        total += iov[i].iov_len;
    return total;
}

/* The first `allowed` bytes of iov, as a new vector in out (at most count entries). */
static int iov_truncate(const struct iovec *iov, int count, size_t allowed, struct iovec *out) {
    int n = 0;
    for (int i = 0; i < count && allowed > 0; i++, n++) {
        out[n] = iov[i];
        if (out[n].iov_len > allowed)
            out[n].iov_len = allowed;
        allowed -= out[n].iov_len;
    }
    return n;
}

#define REAL(name, type) static type real_##name; if (!real_##name) real_##name = (type)dlsym(RTLD_NEXT, #name)

typedef ssize_t (*pread_fn)(int, void *, size_t, off_t);
typedef ssize_t (*preadv_fn)(int, const struct iovec *, int, off_t);
typedef ssize_t (*preadv2_fn)(int, const struct iovec *, int, off_t, int);

static ssize_t faulty_pread(pread_fn real, int fd, void *buffer, size_t count, off_t offset) {
    long long verdict = decide(fd, offset, count);
    if (verdict == PASS)
        return real(fd, buffer, count, offset);
    if (verdict == FAIL_EIO) {
        log_fault("eio", offset, count, -1);
        errno = EIO;
        return -1;
    }
    ssize_t got = verdict ? real(fd, buffer, (size_t)verdict, offset) : 0;
    log_fault("short", offset, count, got);
    return got;
}

static ssize_t faulty_preadv(preadv_fn real, preadv2_fn real2, int fd, const struct iovec *iov, int count,
                             off_t offset, int flags) {
    long long verdict = decide(fd, offset, iov_total(iov, count));
    if (verdict == PASS)
        return real2 ? real2(fd, iov, count, offset, flags) : real(fd, iov, count, offset);
    if (verdict == FAIL_EIO) {
        log_fault("eio", offset, iov_total(iov, count), -1);
        errno = EIO;
        return -1;
    }
    ssize_t got = 0;
    if (verdict > 0) {
        struct iovec cut[count > 0 ? count : 1];
        int n = iov_truncate(iov, count, (size_t)verdict, cut);
        got = real2 ? real2(fd, cut, n, offset, flags) : real(fd, cut, n, offset);
    }
    log_fault("short", offset, iov_total(iov, count), got);
    return got;
}

ssize_t pread(int fd, void *buffer, size_t count, off_t offset) {
    REAL(pread, pread_fn);
    return faulty_pread(real_pread, fd, buffer, count, offset);
}

ssize_t pread64(int fd, void *buffer, size_t count, off_t offset) {
    REAL(pread64, pread_fn);
    return faulty_pread(real_pread64, fd, buffer, count, offset);
}

ssize_t preadv(int fd, const struct iovec *iov, int count, off_t offset) {
    REAL(preadv, preadv_fn);
    return faulty_preadv(real_preadv, NULL, fd, iov, count, offset, 0);
}

ssize_t preadv64(int fd, const struct iovec *iov, int count, off_t offset) {
    REAL(preadv64, preadv_fn);
    return faulty_preadv(real_preadv64, NULL, fd, iov, count, offset, 0);
}

ssize_t preadv2(int fd, const struct iovec *iov, int count, off_t offset, int flags) {
    REAL(preadv2, preadv2_fn);
    return faulty_preadv(NULL, real_preadv2, fd, iov, count, offset, flags);
}

ssize_t preadv64v2(int fd, const struct iovec *iov, int count, off_t offset, int flags) {
    REAL(preadv64v2, preadv2_fn);
    return faulty_preadv(NULL, real_preadv64v2, fd, iov, count, offset, flags);
}
