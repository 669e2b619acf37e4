/*
 * NVTX v3 recording injection library for perfsdk's tests.
 *
 * Load it by pointing NVTX_INJECTION64_PATH at the built shared object. Every
 * NVTX call that reaches it is written as one JSON object per line (JSONL) to
 * the file named by NVTX_RECORD_PATH. The file is opened with O_APPEND and each
 * line goes out in one write() under a mutex, so events survive abnormal exits
 * and lines from several threads (or forked children) never interleave.
 * Without NVTX_RECORD_PATH the library still attaches (it hands out domain and
 * string handles) but records nothing.
 *
 * Every line has: seq, kind, pid, thread (gettid), ts_ns (CLOCK_MONOTONIC) and
 * domain ("" for the default/NULL domain). Kinds and their extra fields:
 *   init            nvtx_version, init_count   (once per NVTX copy attaching)
 *   push            message, message_type, color, category, payload,
 *                   payload_type, level (0 = outermost on this thread+domain)
 *   pop             level (of the range being closed, -1 if nothing was open)
 *   mark            message, message_type, color, category, payload, payload_type
 *   start           same attributes as mark, plus range_id
 *   end             range_id
 *   domain_create   (domain is the new domain's name)
 *   domain_destroy
 *   category        category, name
 *   register_string message (the registered text)
 *   thread_name     os_thread_id, name
 *
 * Build: cc -shared -fPIC -O2 -I<cuda>/include -o librecorder.so recorder.c -lpthread
 */
#define _GNU_SOURCE
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#include <wchar.h>

#ifndef NVTX_PAYLOAD_TYPE_EXT
#define NVTX_PAYLOAD_TYPE_EXT ((int32_t)0xDFBD0009)
#endif

#define REC_EXPORT __attribute__((visibility("default")))

/* Mirror of nvtxPayloadData_t (nvToolsExtPayload.h), used for extended payloads. */
typedef struct rec_payload_data {
    uint64_t schemaId;
    size_t size;
    const void *payload;
} rec_payload_data;

/* ------------------------------------------------------------------------ */
/* Global state                                                              */
/* ------------------------------------------------------------------------ */

typedef struct rec_domain {
    char *name;
    struct rec_domain *next;
} rec_domain;

typedef struct rec_string {
    char *text;
    struct rec_string *next;
} rec_string;

#define STRING_BUCKETS 1024

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_fd = -1; /* -1: recording disabled */
static uint64_t g_seq = 0;
static uint64_t g_next_range_id = 0;
static unsigned g_init_count = 0;
static rec_domain *g_domains = NULL;
static rec_string *g_strings[STRING_BUCKETS];

static __thread pid_t t_tid = 0;
static pid_t g_pid = 0;

/* Per-thread push depth per domain, only used for the push/pop return values
 * and the "level" field. */
#define MAX_TRACKED_DOMAINS 64
typedef struct {
    const void *domain;
    int depth;
} rec_depth;
static __thread rec_depth t_depths[MAX_TRACKED_DOMAINS];
static __thread int t_ndepths = 0;

static pid_t cur_tid(void)
{
    if (t_tid == 0) {
        t_tid = (pid_t)syscall(SYS_gettid);
    }
    return t_tid;
}

static pid_t cur_pid(void)
{
    if (g_pid == 0) {
        g_pid = getpid();
    }
    return g_pid;
}

static int *depth_slot(const void *domain)
{
    int i;
    for (i = 0; i < t_ndepths; ++i) {
        if (t_depths[i].domain == domain) {
            return &t_depths[i].depth;
        }
    }
    if (t_ndepths < MAX_TRACKED_DOMAINS) {
        t_depths[t_ndepths].domain = domain;
        t_depths[t_ndepths].depth = 0;
        return &t_depths[t_ndepths++].depth;
    }
    return NULL;
}

static void atfork_prepare(void) { pthread_mutex_lock(&g_lock); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_lock); }
static void atfork_child(void)
{
    t_tid = 0;
    g_pid = 0;
    pthread_mutex_unlock(&g_lock);
}

static void global_init(void)
{
    const char *path = getenv("NVTX_RECORD_PATH");
    if (path != NULL && path[0] != '\0') {
        g_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (g_fd < 0) {
            fprintf(stderr, "nvtx recorder: cannot open NVTX_RECORD_PATH '%s': %s\n", path,
                    strerror(errno));
        }
    }
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* ------------------------------------------------------------------------ */
/* String builder / JSON helpers                                             */
/* ------------------------------------------------------------------------ */

typedef struct sb {
    char *buf;
    size_t len;
    size_t cap;
    int heap;
    int oom;
    char inline_buf[1024];
} sb_t;

static void sb_init(sb_t *sb)
{
    sb->buf = sb->inline_buf;
    sb->len = 0;
    sb->cap = sizeof(sb->inline_buf);
    sb->heap = 0;
    sb->oom = 0;
}

static void sb_free(sb_t *sb)
{
    if (sb->heap) {
        free(sb->buf);
    }
}

static int sb_reserve(sb_t *sb, size_t extra)
{
    size_t need = sb->len + extra + 1;
    size_t cap;
    char *nb;
    if (sb->oom) {
        return 0;
    }
    if (need <= sb->cap) {
        return 1;
    }
    cap = sb->cap * 2;
    while (cap < need) {
        cap *= 2;
    }
    if (sb->heap) {
        nb = (char *)realloc(sb->buf, cap);
    } else {
        nb = (char *)malloc(cap);
        if (nb != NULL) {
            memcpy(nb, sb->buf, sb->len);
        }
    }
    if (nb == NULL) {
        sb->oom = 1;
        return 0;
    }
    sb->buf = nb;
    sb->cap = cap;
    sb->heap = 1;
    return 1;
}

static void sb_putn(sb_t *sb, const char *s, size_t n)
{
    if (!sb_reserve(sb, n)) {
        return;
    }
    memcpy(sb->buf + sb->len, s, n);
    sb->len += n;
}

static void sb_puts(sb_t *sb, const char *s) { sb_putn(sb, s, strlen(s)); }

static void sb_printf(sb_t *sb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sb_t *sb, const char *fmt, ...)
{
    char tmp[128];
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    if (n < 0) {
        return;
    }
    if ((size_t)n < sizeof(tmp)) {
        sb_putn(sb, tmp, (size_t)n);
        return;
    }
    if (!sb_reserve(sb, (size_t)n)) {
        return;
    }
    va_start(ap, fmt);
    vsnprintf(sb->buf + sb->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb->len += (size_t)n;
}

/* JSON string of UTF-8 (or arbitrary) bytes; NULL -> null. Bytes >= 0x80 are
 * copied verbatim; the Python side decodes with errors="replace". */
static void sb_json_str(sb_t *sb, const char *s)
{
    const unsigned char *p;
    if (s == NULL) {
        sb_puts(sb, "null");
        return;
    }
    sb_putn(sb, "\"", 1);
    for (p = (const unsigned char *)s; *p; ++p) {
        unsigned char c = *p;
        switch (c) {
        case '"': sb_putn(sb, "\\\"", 2); break;
        case '\\': sb_putn(sb, "\\\\", 2); break;
        case '\n': sb_putn(sb, "\\n", 2); break;
        case '\r': sb_putn(sb, "\\r", 2); break;
        case '\t': sb_putn(sb, "\\t", 2); break;
        default:
            if (c < 0x20 || c == 0x7f) {
                sb_printf(sb, "\\u%04x", (unsigned)c);
            } else {
                sb_putn(sb, (const char *)p, 1);
            }
        }
    }
    sb_putn(sb, "\"", 1);
}

static void sb_json_double(sb_t *sb, double v)
{
    /* Python's json module accepts these non-standard tokens. */
    if (isnan(v)) {
        sb_puts(sb, "NaN");
    } else if (isinf(v)) {
        sb_puts(sb, v > 0 ? "Infinity" : "-Infinity");
    } else {
        sb_printf(sb, "%.17g", v);
    }
}

/* wchar_t (UTF-32 on Linux) -> freshly malloc'd UTF-8. */
static char *wide_to_utf8(const wchar_t *w)
{
    size_t n = 0, i, o = 0;
    char *out;
    if (w == NULL) {
        return NULL;
    }
    while (w[n] != 0) {
        ++n;
    }
    out = (char *)malloc(n * 4 + 1);
    if (out == NULL) {
        return NULL;
    }
    for (i = 0; i < n; ++i) {
        uint32_t c = (uint32_t)w[i];
        if (c < 0x80) {
            out[o++] = (char)c;
        } else if (c < 0x800) {
            out[o++] = (char)(0xC0 | (c >> 6));
            out[o++] = (char)(0x80 | (c & 0x3F));
        } else if (c < 0x10000) {
            out[o++] = (char)(0xE0 | (c >> 12));
            out[o++] = (char)(0x80 | ((c >> 6) & 0x3F));
            out[o++] = (char)(0x80 | (c & 0x3F));
        } else if (c < 0x110000) {
            out[o++] = (char)(0xF0 | (c >> 18));
            out[o++] = (char)(0x80 | ((c >> 12) & 0x3F));
            out[o++] = (char)(0x80 | ((c >> 6) & 0x3F));
            out[o++] = (char)(0x80 | (c & 0x3F));
        } else {
            out[o++] = '?';
        }
    }
    out[o] = '\0';
    return out;
}

/* ------------------------------------------------------------------------ */
/* Registries (callers hold g_lock)                                          */
/* ------------------------------------------------------------------------ */

static rec_domain *find_domain_locked(const void *handle)
{
    rec_domain *d;
    for (d = g_domains; d != NULL; d = d->next) {
        if ((const void *)d == handle) {
            return d;
        }
    }
    return NULL;
}

/* Name recorded for a domain handle; the default domain (NULL) is "". */
static const char *domain_name_locked(const void *handle, char *scratch, size_t scratch_len)
{
    rec_domain *d;
    if (handle == NULL) {
        return "";
    }
    d = find_domain_locked(handle);
    if (d != NULL) {
        return d->name;
    }
    snprintf(scratch, scratch_len, "<unknown domain %p>", handle);
    return scratch;
}

static size_t string_bucket(const void *p)
{
    uintptr_t v = (uintptr_t)p;
    return (size_t)((v >> 4) ^ (v >> 14)) % STRING_BUCKETS;
}

static const char *registered_text_locked(const void *handle)
{
    rec_string *s;
    if (handle == NULL) {
        return NULL;
    }
    for (s = g_strings[string_bucket(handle)]; s != NULL; s = s->next) {
        if ((const void *)s == handle) {
            return s->text;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Event emission                                                            */
/* ------------------------------------------------------------------------ */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Caller holds g_lock and has checked g_fd >= 0. */
static void event_begin_locked(sb_t *sb, const char *kind, const char *domain)
{
    sb_init(sb);
    sb_printf(sb, "{\"seq\":%" PRIu64 ",\"kind\":", ++g_seq);
    sb_json_str(sb, kind);
    sb_printf(sb, ",\"pid\":%ld,\"thread\":%ld,\"ts_ns\":%" PRIu64 ",\"domain\":",
              (long)cur_pid(), (long)cur_tid(), now_ns());
    sb_json_str(sb, domain);
}

static void event_end_locked(sb_t *sb)
{
    size_t off = 0;
    sb_putn(sb, "}\n", 2);
    if (!sb->oom) {
        while (off < sb->len) {
            ssize_t n = write(g_fd, sb->buf + off, sb->len - off);
            if (n < 0) {
                if (errno == EINTR) {
                    continue;
                }
                break;
            }
            off += (size_t)n;
        }
    }
    sb_free(sb);
}

#define HAS_FIELD(attr, field) \
    ((size_t)(attr)->size >= offsetof(nvtxEventAttributes_t, field) + sizeof((attr)->field))

static void emit_attributes_locked(sb_t *sb, const nvtxEventAttributes_t *attr)
{
    const char *message = NULL;
    const char *message_type = NULL;
    char *converted = NULL;

    if (attr == NULL) {
        sb_puts(sb, ",\"message\":null,\"message_type\":null,\"color\":null,\"category\":0,"
                    "\"payload\":null,\"payload_type\":null");
        return;
    }

    if (HAS_FIELD(attr, message)) {
        switch (attr->messageType) {
        case NVTX_MESSAGE_TYPE_ASCII:
            message_type = "ascii";
            message = attr->message.ascii;
            break;
        case NVTX_MESSAGE_TYPE_UNICODE:
            message_type = "unicode";
            converted = wide_to_utf8(attr->message.unicode);
            message = converted;
            break;
        case NVTX_MESSAGE_TYPE_REGISTERED:
            message_type = "registered";
            message = registered_text_locked((const void *)attr->message.registered);
            break;
        default:
            break;
        }
    }
    sb_puts(sb, ",\"message\":");
    sb_json_str(sb, message);
    sb_puts(sb, ",\"message_type\":");
    sb_json_str(sb, message_type);
    free(converted);

    if (HAS_FIELD(attr, color) && attr->colorType == NVTX_COLOR_ARGB) {
        sb_printf(sb, ",\"color\":%" PRIu32, attr->color);
    } else {
        sb_puts(sb, ",\"color\":null");
    }

    sb_printf(sb, ",\"category\":%" PRIu32, HAS_FIELD(attr, category) ? attr->category : 0u);

    if (!HAS_FIELD(attr, payload)) {
        sb_puts(sb, ",\"payload\":null,\"payload_type\":null");
        return;
    }
    switch (attr->payloadType) {
    case NVTX_PAYLOAD_TYPE_UNSIGNED_INT64:
        sb_printf(sb, ",\"payload\":%" PRIu64 ",\"payload_type\":\"uint64\"",
                  attr->payload.ullValue);
        break;
    case NVTX_PAYLOAD_TYPE_INT64:
        sb_printf(sb, ",\"payload\":%" PRId64 ",\"payload_type\":\"int64\"",
                  attr->payload.llValue);
        break;
    case NVTX_PAYLOAD_TYPE_UNSIGNED_INT32:
        sb_printf(sb, ",\"payload\":%" PRIu32 ",\"payload_type\":\"uint32\"",
                  attr->payload.uiValue);
        break;
    case NVTX_PAYLOAD_TYPE_INT32:
        sb_printf(sb, ",\"payload\":%" PRId32 ",\"payload_type\":\"int32\"",
                  attr->payload.iValue);
        break;
    case NVTX_PAYLOAD_TYPE_DOUBLE:
        sb_puts(sb, ",\"payload\":");
        sb_json_double(sb, attr->payload.dValue);
        sb_puts(sb, ",\"payload_type\":\"double\"");
        break;
    case NVTX_PAYLOAD_TYPE_FLOAT:
        sb_puts(sb, ",\"payload\":");
        sb_json_double(sb, (double)attr->payload.fValue);
        sb_puts(sb, ",\"payload_type\":\"float\"");
        break;
    case NVTX_PAYLOAD_UNKNOWN:
        sb_puts(sb, ",\"payload\":null,\"payload_type\":null");
        break;
    default:
        if (attr->payloadType == NVTX_PAYLOAD_TYPE_EXT) {
            /* Extended payload: ullValue points at reserved0 nvtxPayloadData_t
             * entries. Record schema id and size of each (not the bytes). */
            const rec_payload_data *pd =
                (const rec_payload_data *)(uintptr_t)attr->payload.ullValue;
            int count = HAS_FIELD(attr, reserved0) ? attr->reserved0 : 0;
            int i;
            sb_puts(sb, ",\"payload\":[");
            if (pd != NULL) {
                for (i = 0; i < count && i < 64; ++i) {
                    sb_printf(sb, "%s{\"schema_id\":%" PRIu64 ",\"size\":%zu}", i ? "," : "",
                              pd[i].schemaId, pd[i].size);
                }
            }
            sb_puts(sb, "],\"payload_type\":\"ext\"");
        } else {
            sb_printf(sb, ",\"payload\":null,\"payload_type\":\"unknown:%" PRId32 "\"",
                      attr->payloadType);
        }
        break;
    }
}

/* Message-only events from the A/W variants, shaped like attribute events. */
static void emit_plain_message_locked(sb_t *sb, const char *message, const char *type)
{
    sb_puts(sb, ",\"message\":");
    sb_json_str(sb, message);
    sb_puts(sb, ",\"message_type\":");
    sb_json_str(sb, message != NULL ? type : NULL);
    sb_puts(sb, ",\"color\":null,\"category\":0,\"payload\":null,\"payload_type\":null");
}

/* ------------------------------------------------------------------------ */
/* Shared implementations                                                    */
/* ------------------------------------------------------------------------ */

enum { MSG_ATTR, MSG_ASCII, MSG_WIDE };

typedef struct {
    int form;
    const nvtxEventAttributes_t *attr;
    const char *ascii;
    const wchar_t *wide;
} rec_msg;

static void emit_event_with_message(const char *kind, const void *domain, const rec_msg *m,
                                    const char *extra_key, int64_t extra_val)
{
    char scratch[64];
    sb_t sb;
    if (g_fd < 0) {
        return;
    }
    event_begin_locked(&sb, kind, domain_name_locked(domain, scratch, sizeof scratch));
    if (m->form == MSG_ATTR) {
        emit_attributes_locked(&sb, m->attr);
    } else if (m->form == MSG_ASCII) {
        emit_plain_message_locked(&sb, m->ascii, "ascii");
    } else {
        char *conv = wide_to_utf8(m->wide);
        emit_plain_message_locked(&sb, conv, "unicode");
        free(conv);
    }
    if (extra_key != NULL) {
        sb_printf(&sb, ",\"%s\":%" PRId64, extra_key, extra_val);
    }
    event_end_locked(&sb);
}

static int do_push(const void *domain, const rec_msg *m)
{
    int *slot = depth_slot(domain);
    int level = slot != NULL ? (*slot)++ : 0;
    pthread_mutex_lock(&g_lock);
    emit_event_with_message("push", domain, m, "level", (int64_t)level);
    pthread_mutex_unlock(&g_lock);
    return level;
}

static int do_pop(const void *domain)
{
    int *slot = depth_slot(domain);
    int level = -1;
    char scratch[64];
    sb_t sb;
    if (slot != NULL && *slot > 0) {
        level = --(*slot);
    }
    pthread_mutex_lock(&g_lock);
    if (g_fd >= 0) {
        event_begin_locked(&sb, "pop", domain_name_locked(domain, scratch, sizeof scratch));
        sb_printf(&sb, ",\"level\":%d", level);
        event_end_locked(&sb);
    }
    pthread_mutex_unlock(&g_lock);
    return level;
}

static void do_mark(const void *domain, const rec_msg *m)
{
    pthread_mutex_lock(&g_lock);
    emit_event_with_message("mark", domain, m, NULL, 0);
    pthread_mutex_unlock(&g_lock);
}

static nvtxRangeId_t do_start(const void *domain, const rec_msg *m)
{
    nvtxRangeId_t id = __atomic_add_fetch(&g_next_range_id, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_lock(&g_lock);
    emit_event_with_message("start", domain, m, "range_id", (int64_t)id);
    pthread_mutex_unlock(&g_lock);
    return id;
}

static void do_end(const void *domain, nvtxRangeId_t id)
{
    char scratch[64];
    sb_t sb;
    pthread_mutex_lock(&g_lock);
    if (g_fd >= 0) {
        event_begin_locked(&sb, "end", domain_name_locked(domain, scratch, sizeof scratch));
        sb_printf(&sb, ",\"range_id\":%" PRIu64, (uint64_t)id);
        event_end_locked(&sb);
    }
    pthread_mutex_unlock(&g_lock);
}

static void do_name_category(const void *domain, uint32_t category, const char *name)
{
    char scratch[64];
    sb_t sb;
    pthread_mutex_lock(&g_lock);
    if (g_fd >= 0) {
        event_begin_locked(&sb, "category", domain_name_locked(domain, scratch, sizeof scratch));
        sb_printf(&sb, ",\"category\":%" PRIu32 ",\"name\":", category);
        sb_json_str(&sb, name);
        event_end_locked(&sb);
    }
    pthread_mutex_unlock(&g_lock);
}

static nvtxDomainHandle_t do_domain_create(const char *name)
{
    rec_domain *d;
    sb_t sb;
    if (name == NULL) {
        name = "";
    }
    pthread_mutex_lock(&g_lock);
    /* Same name -> same handle (handles are never freed, so stale handles
     * used after nvtxDomainDestroy still resolve to their name). */
    for (d = g_domains; d != NULL; d = d->next) {
        if (strcmp(d->name, name) == 0) {
            break;
        }
    }
    if (d == NULL) {
        d = (rec_domain *)calloc(1, sizeof *d);
        if (d != NULL) {
            d->name = strdup(name);
            if (d->name == NULL) {
                free(d);
                d = NULL;
            } else {
                d->next = g_domains;
                g_domains = d;
            }
        }
    }
    if (g_fd >= 0) {
        event_begin_locked(&sb, "domain_create", name);
        event_end_locked(&sb);
    }
    pthread_mutex_unlock(&g_lock);
    return (nvtxDomainHandle_t)(void *)d;
}

static nvtxStringHandle_t do_register_string(const void *domain, const char *text)
{
    rec_string *s;
    char scratch[64];
    sb_t sb;
    if (text == NULL) {
        return NULL;
    }
    s = (rec_string *)calloc(1, sizeof *s);
    if (s == NULL) {
        return NULL;
    }
    s->text = strdup(text);
    if (s->text == NULL) {
        free(s);
        return NULL;
    }
    pthread_mutex_lock(&g_lock);
    s->next = g_strings[string_bucket(s)];
    g_strings[string_bucket(s)] = s;
    if (g_fd >= 0) {
        event_begin_locked(&sb, "register_string",
                           domain_name_locked(domain, scratch, sizeof scratch));
        sb_puts(&sb, ",\"message\":");
        sb_json_str(&sb, text);
        event_end_locked(&sb);
    }
    pthread_mutex_unlock(&g_lock);
    return (nvtxStringHandle_t)(void *)s;
}

/* ------------------------------------------------------------------------ */
/* NVTX_CB_MODULE_CORE callbacks (default domain)                            */
/* ------------------------------------------------------------------------ */

static void NVTX_API cb_MarkEx(const nvtxEventAttributes_t *a)
{
    rec_msg m = {MSG_ATTR, a, NULL, NULL};
    do_mark(NULL, &m);
}
static void NVTX_API cb_MarkA(const char *s)
{
    rec_msg m = {MSG_ASCII, NULL, s, NULL};
    do_mark(NULL, &m);
}
static void NVTX_API cb_MarkW(const wchar_t *s)
{
    rec_msg m = {MSG_WIDE, NULL, NULL, s};
    do_mark(NULL, &m);
}
static nvtxRangeId_t NVTX_API cb_RangeStartEx(const nvtxEventAttributes_t *a)
{
    rec_msg m = {MSG_ATTR, a, NULL, NULL};
    return do_start(NULL, &m);
}
static nvtxRangeId_t NVTX_API cb_RangeStartA(const char *s)
{
    rec_msg m = {MSG_ASCII, NULL, s, NULL};
    return do_start(NULL, &m);
}
static nvtxRangeId_t NVTX_API cb_RangeStartW(const wchar_t *s)
{
    rec_msg m = {MSG_WIDE, NULL, NULL, s};
    return do_start(NULL, &m);
}
static void NVTX_API cb_RangeEnd(nvtxRangeId_t id) { do_end(NULL, id); }
static int NVTX_API cb_RangePushEx(const nvtxEventAttributes_t *a)
{
    rec_msg m = {MSG_ATTR, a, NULL, NULL};
    return do_push(NULL, &m);
}
static int NVTX_API cb_RangePushA(const char *s)
{
    rec_msg m = {MSG_ASCII, NULL, s, NULL};
    return do_push(NULL, &m);
}
static int NVTX_API cb_RangePushW(const wchar_t *s)
{
    rec_msg m = {MSG_WIDE, NULL, NULL, s};
    return do_push(NULL, &m);
}
static int NVTX_API cb_RangePop(void) { return do_pop(NULL); }
static void NVTX_API cb_NameCategoryA(uint32_t category, const char *name)
{
    do_name_category(NULL, category, name);
}
static void NVTX_API cb_NameCategoryW(uint32_t category, const wchar_t *name)
{
    char *conv = wide_to_utf8(name);
    do_name_category(NULL, category, conv);
    free(conv);
}
static void name_os_thread(uint32_t thread_id, const char *name)
{
    sb_t sb;
    pthread_mutex_lock(&g_lock);
    if (g_fd >= 0) {
        event_begin_locked(&sb, "thread_name", "");
        sb_printf(&sb, ",\"os_thread_id\":%" PRIu32 ",\"name\":", thread_id);
        sb_json_str(&sb, name);
        event_end_locked(&sb);
    }
    pthread_mutex_unlock(&g_lock);
}
static void NVTX_API cb_NameOsThreadA(uint32_t thread_id, const char *name)
{
    name_os_thread(thread_id, name);
}
static void NVTX_API cb_NameOsThreadW(uint32_t thread_id, const wchar_t *name)
{
    char *conv = wide_to_utf8(name);
    name_os_thread(thread_id, conv);
    free(conv);
}

/* ------------------------------------------------------------------------ */
/* NVTX_CB_MODULE_CORE2 callbacks (domains)                                  */
/* ------------------------------------------------------------------------ */

static void NVTX_API cb_DomainMarkEx(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a)
{
    rec_msg m = {MSG_ATTR, a, NULL, NULL};
    do_mark(d, &m);
}
static nvtxRangeId_t NVTX_API cb_DomainRangeStartEx(nvtxDomainHandle_t d,
                                                    const nvtxEventAttributes_t *a)
{
    rec_msg m = {MSG_ATTR, a, NULL, NULL};
    return do_start(d, &m);
}
static void NVTX_API cb_DomainRangeEnd(nvtxDomainHandle_t d, nvtxRangeId_t id) { do_end(d, id); }
static int NVTX_API cb_DomainRangePushEx(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a)
{
    rec_msg m = {MSG_ATTR, a, NULL, NULL};
    return do_push(d, &m);
}
static int NVTX_API cb_DomainRangePop(nvtxDomainHandle_t d) { return do_pop(d); }
static void NVTX_API cb_DomainNameCategoryA(nvtxDomainHandle_t d, uint32_t category,
                                            const char *name)
{
    do_name_category(d, category, name);
}
static void NVTX_API cb_DomainNameCategoryW(nvtxDomainHandle_t d, uint32_t category,
                                            const wchar_t *name)
{
    char *conv = wide_to_utf8(name);
    do_name_category(d, category, conv);
    free(conv);
}
static nvtxStringHandle_t NVTX_API cb_DomainRegisterStringA(nvtxDomainHandle_t d, const char *s)
{
    return do_register_string(d, s);
}
static nvtxStringHandle_t NVTX_API cb_DomainRegisterStringW(nvtxDomainHandle_t d,
                                                            const wchar_t *s)
{
    char *conv = wide_to_utf8(s);
    nvtxStringHandle_t h = do_register_string(d, conv);
    free(conv);
    return h;
}
static nvtxDomainHandle_t NVTX_API cb_DomainCreateA(const char *name)
{
    return do_domain_create(name);
}
static nvtxDomainHandle_t NVTX_API cb_DomainCreateW(const wchar_t *name)
{
    char *conv = wide_to_utf8(name);
    nvtxDomainHandle_t h = do_domain_create(conv);
    free(conv);
    return h;
}
static void NVTX_API cb_DomainDestroy(nvtxDomainHandle_t d)
{
    char scratch[64];
    sb_t sb;
    pthread_mutex_lock(&g_lock);
    if (g_fd >= 0) {
        event_begin_locked(&sb, "domain_destroy", domain_name_locked(d, scratch, sizeof scratch));
        event_end_locked(&sb);
    }
    pthread_mutex_unlock(&g_lock);
}
static void NVTX_API cb_Initialize(const void *reserved) { (void)reserved; }

/* ------------------------------------------------------------------------ */
/* Attach                                                                    */
/* ------------------------------------------------------------------------ */

typedef struct {
    unsigned id;
    NvtxFunctionPointer fn;
} rec_binding;

#define BIND(id, fn) {(unsigned)(id), (NvtxFunctionPointer)(fn)}

static const rec_binding k_core[] = {
    BIND(NVTX_CBID_CORE_MarkEx, cb_MarkEx),
    BIND(NVTX_CBID_CORE_MarkA, cb_MarkA),
    BIND(NVTX_CBID_CORE_MarkW, cb_MarkW),
    BIND(NVTX_CBID_CORE_RangeStartEx, cb_RangeStartEx),
    BIND(NVTX_CBID_CORE_RangeStartA, cb_RangeStartA),
    BIND(NVTX_CBID_CORE_RangeStartW, cb_RangeStartW),
    BIND(NVTX_CBID_CORE_RangeEnd, cb_RangeEnd),
    BIND(NVTX_CBID_CORE_RangePushEx, cb_RangePushEx),
    BIND(NVTX_CBID_CORE_RangePushA, cb_RangePushA),
    BIND(NVTX_CBID_CORE_RangePushW, cb_RangePushW),
    BIND(NVTX_CBID_CORE_RangePop, cb_RangePop),
    BIND(NVTX_CBID_CORE_NameCategoryA, cb_NameCategoryA),
    BIND(NVTX_CBID_CORE_NameCategoryW, cb_NameCategoryW),
    BIND(NVTX_CBID_CORE_NameOsThreadA, cb_NameOsThreadA),
    BIND(NVTX_CBID_CORE_NameOsThreadW, cb_NameOsThreadW),
};

static const rec_binding k_core2[] = {
    BIND(NVTX_CBID_CORE2_DomainMarkEx, cb_DomainMarkEx),
    BIND(NVTX_CBID_CORE2_DomainRangeStartEx, cb_DomainRangeStartEx),
    BIND(NVTX_CBID_CORE2_DomainRangeEnd, cb_DomainRangeEnd),
    BIND(NVTX_CBID_CORE2_DomainRangePushEx, cb_DomainRangePushEx),
    BIND(NVTX_CBID_CORE2_DomainRangePop, cb_DomainRangePop),
    BIND(NVTX_CBID_CORE2_DomainNameCategoryA, cb_DomainNameCategoryA),
    BIND(NVTX_CBID_CORE2_DomainNameCategoryW, cb_DomainNameCategoryW),
    BIND(NVTX_CBID_CORE2_DomainRegisterStringA, cb_DomainRegisterStringA),
    BIND(NVTX_CBID_CORE2_DomainRegisterStringW, cb_DomainRegisterStringW),
    BIND(NVTX_CBID_CORE2_DomainCreateA, cb_DomainCreateA),
    BIND(NVTX_CBID_CORE2_DomainCreateW, cb_DomainCreateW),
    BIND(NVTX_CBID_CORE2_DomainDestroy, cb_DomainDestroy),
    BIND(NVTX_CBID_CORE2_Initialize, cb_Initialize),
};

static int bind_module(const NvtxExportTableCallbacks *etbl, NvtxCallbackModule module,
                       const rec_binding *bindings, size_t n)
{
    NvtxFunctionTable table = NULL;
    unsigned int size = 0;
    size_t i;
    if (!etbl->GetModuleFunctionTable(module, &table, &size) || table == NULL) {
        return 0;
    }
    /* size is the number of callback ids (valid ids are 1 .. size-1). */
    for (i = 0; i < n; ++i) {
        unsigned id = bindings[i].id;
        if (id < size && table[id] != NULL) {
            *table[id] = bindings[i].fn;
        }
    }
    return 1;
}

REC_EXPORT int NVTX_API InitializeInjectionNvtx2(NvtxGetExportTableFunc_t getExportTable)
{
    const NvtxExportTableCallbacks *etbl;
    const NvtxExportTableVersionInfo *vinfo;
    uint32_t version = 0;
    unsigned count;
    sb_t sb;

    if (getExportTable == NULL) {
        return 0;
    }
    pthread_once(&g_once, global_init);

    etbl = (const NvtxExportTableCallbacks *)getExportTable(NVTX_ETID_CALLBACKS);
    if (etbl == NULL || etbl->struct_size < sizeof(NvtxExportTableCallbacks) ||
        etbl->GetModuleFunctionTable == NULL) {
        return 0;
    }
    vinfo = (const NvtxExportTableVersionInfo *)getExportTable(NVTX_ETID_VERSIONINFO);
    if (vinfo != NULL && vinfo->struct_size >= sizeof(NvtxExportTableVersionInfo)) {
        version = vinfo->version;
        if (vinfo->SetInjectionNvtxVersion != NULL) {
            vinfo->SetInjectionNvtxVersion(NVTX_VERSION);
        }
    }

    if (!bind_module(etbl, NVTX_CB_MODULE_CORE, k_core, sizeof k_core / sizeof k_core[0])) {
        return 0;
    }
    bind_module(etbl, NVTX_CB_MODULE_CORE2, k_core2, sizeof k_core2 / sizeof k_core2[0]);

    pthread_mutex_lock(&g_lock);
    count = ++g_init_count;
    if (g_fd >= 0) {
        event_begin_locked(&sb, "init", "");
        sb_printf(&sb, ",\"nvtx_version\":%" PRIu32 ",\"init_count\":%u", version, count);
        event_end_locked(&sb);
    }
    pthread_mutex_unlock(&g_lock);
    return 1;
}
