#include "base/file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *kind_of(mode_t m) {
    return S_ISDIR(m)    ? "a directory"
           : S_ISFIFO(m) ? "a FIFO"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
           : S_ISSOCK(m) ? "a socket"
                         : "not a regular file";
}

int file_open_regular(const char *path, const char *what, uint64_t *size, ar_error_t *err) {
    const char *sp = what ? " " : "", *w = what ? what : "";
    /* O_NONBLOCK: opening a FIFO does not wait for its writer. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        ar_errorf(err, "%s: cannot open%s%s: %s", path, sp, w, strerror(errno));
        return -1;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        ar_errorf(err, "%s: cannot read%s%s: %s", path, sp, w, strerror(errno));
        close(fd);
        return -1;
    }
    if (!S_ISREG(sb.st_mode)) {
        ar_errorf(err, "%s: cannot read%s%s: not a regular file (%s)", path, sp, w,
                  kind_of(sb.st_mode));
        close(fd);
        return -1;
    }
    /* Reads block as usual from here (a regular file never waits anyway). */
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0)
        (void)fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    if (size)
        *size = (uint64_t)sb.st_size;
    return fd;
}

char *file_read_all(const char *path, const char *what, size_t max, size_t *len, ar_error_t *err) {
    const char *sp = what ? " " : "", *w = what ? what : "";
    uint64_t size;
    int fd = file_open_regular(path, what, &size, err);
    if (fd < 0)
        return NULL;
    if (size > max) {
        ar_errorf(err, "%s: %s is %llu bytes, more than the %zu it may have", path,
                  what ? what : "the file", (unsigned long long)size, max);
        close(fd);
        return NULL;
    }
    char *buf = malloc((size_t)size + 1);
    if (!buf) {
        ar_errorf(err, "%s: out of memory reading%s%s (%llu bytes)", path, sp, w,
                  (unsigned long long)size);
        close(fd);
        return NULL;
    }
    /* The size fstat gave: a file that grows meanwhile is read to it, one
     * that shrinks is an error. */
    size_t n = 0;
    while (n < size) {
        ssize_t got = read(fd, buf + n, (size_t)size - n);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) {
            ar_errorf(err, "%s: cannot read%s%s: %s", path, sp, w,
                      got < 0 ? strerror(errno) : "the file shrank while it was read");
            free(buf);
            close(fd);
            return NULL;
        }
        n += (size_t)got;
    }
    close(fd);
    buf[n] = 0;
    if (len)
        *len = n;
    return buf;
}
