/*
 * kvf_config.c: defaults < config file < environment < command line, from
 * one table of settings (see kvf_config.h).
 */
#include "kvf_config.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* Strings read from the config file live until kvf_config_free(). */
static char **kept;
static size_t nkept;

static const char *keep(const char *s)
{
    char **v = realloc(kept, (nkept + 1) * sizeof(*v));
    if (v == NULL)
        return NULL;
    kept = v;
    kept[nkept] = strdup(s);
    return kept[nkept] != NULL ? kept[nkept++] : NULL;
}

void kvf_config_free(void)
{
    for (size_t i = 0; i < nkept; i++)
        free(kept[i]);
    free(kept);
    kept = NULL;
    nkept = 0;
}

static const struct kvf_config_item *find(const struct kvf_config_item *items, size_t n,
                                          const char *name, size_t len)
{
    for (size_t i = 0; i < n; i++) {
        if (strlen(items[i].name) == len && strncmp(items[i].name, name, len) == 0)
            return &items[i];
    }
    return NULL;
}

static void env_name(char *out, size_t cap, const char *prefix, const char *name)
{
    size_t o = (size_t)snprintf(out, cap, "%s", prefix);
    for (const char *p = name; *p && o + 1 < cap; p++)
        out[o++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    out[o < cap ? o : cap - 1] = '\0';
}

/* Stores `val` into `it`; `src` names where it came from, for messages. */
static int set_value(const struct kvf_config_item *it, const char *val, bool from_file,
                     const char *src, struct kvf_error *err)
{
    switch (it->kind) {
    case KVF_CONFIG_STRING: {
        const char *v = from_file ? keep(val) : val;
        if (v == NULL)
            return kvf_error_set(err, -ENOMEM, "%s: out of memory", src);
        *(const char **)it->value = v;
        return 0;
    }
    case KVF_CONFIG_UINT: {
        char *end = NULL;
        errno = 0;
        unsigned long long u = strtoull(val, &end, 10);
        if (val[0] == '\0' || val[0] == '-' || *end != '\0' || errno != 0 ||
            (it->max != 0 && u > it->max))
            return kvf_error_set(err, -EINVAL, "%s: '%s' is not a number 0..%llu", src, val,
                                 it->max != 0 ? (unsigned long long)it->max : ~0ull);
        *(uint64_t *)it->value = u;
        return 0;
    }
    case KVF_CONFIG_BOOL:
        if (strcmp(val, "true") == 0 || strcmp(val, "1") == 0 || strcmp(val, "yes") == 0) {
            *(bool *)it->value = true;
        } else if (strcmp(val, "false") == 0 || strcmp(val, "0") == 0 || strcmp(val, "no") == 0) {
            *(bool *)it->value = false;
        } else {
            return kvf_error_set(err, -EINVAL, "%s: '%s' is not true or false", src, val);
        }
        return 0;
    }
    return kvf_error_set(err, -EINVAL, "%s: bad setting kind", src);
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t len = strlen(s);
    while (len > 0 && isspace((unsigned char)s[len - 1]))
        s[--len] = '\0';
    return s;
}

static int parse_file(const struct kvf_config_item *items, size_t n, const char *path,
                      struct kvf_error *err)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return kvf_error_set(err, -EINVAL, "config file %s: %s", path, strerror(errno));
    char line[4096];
    int lineno = 0, rc = 0;
    while (rc == 0 && fgets(line, sizeof(line), f) != NULL) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash != NULL)
            *hash = '\0';
        char *s = trim(line);
        if (*s == '\0')
            continue;
        char *eq = strchr(s, '=');
        char src[512];
        snprintf(src, sizeof(src), "%s:%d", path, lineno);
        if (eq == NULL) {
            rc = kvf_error_set(err, -EINVAL, "%s: expected 'name = value'", src);
            break;
        }
        *eq = '\0';
        char *name = trim(s), *val = trim(eq + 1);
        const struct kvf_config_item *it = find(items, n, name, strlen(name));
        if (it == NULL)
            rc = kvf_error_set(err, -EINVAL, "%s: unknown setting '%s'", src, name);
        else
            rc = set_value(it, val, true, src, err);
    }
    fclose(f);
    return rc;
}

void kvf_config_usage(const struct kvf_config_item *items, size_t n, const char *env_prefix,
                      FILE *out)
{
    char env[128];
    env_name(env, sizeof(env), env_prefix, "config");
    fprintf(out, "  --config PATH  (%s)\n      settings file: 'name = value' lines\n", env);
    for (size_t i = 0; i < n; i++) {
        const struct kvf_config_item *it = &items[i];
        env_name(env, sizeof(env), env_prefix, it->name);
        char def[64] = "";
        if (it->kind == KVF_CONFIG_STRING && *(const char **)it->value != NULL)
            snprintf(def, sizeof(def), " [%s]", *(const char **)it->value);
        else if (it->kind == KVF_CONFIG_UINT)
            snprintf(def, sizeof(def), " [%llu]", (unsigned long long)*(uint64_t *)it->value);
        else if (it->kind == KVF_CONFIG_BOOL)
            snprintf(def, sizeof(def), " [%s]", *(bool *)it->value ? "true" : "false");
        fprintf(out, "  --%s%s  (%s)%s\n      %s\n", it->name,
                it->kind == KVF_CONFIG_BOOL ? "" : " VALUE", env, def, it->help);
    }
    fprintf(out, "Precedence: command line > environment > config file > default.\n");
}

int kvf_config_parse(const struct kvf_config_item *items, size_t n, const char *env_prefix,
                     int argc, char **argv, FILE *out, struct kvf_error *err)
{
    char env[128];
    /* The config file: --config on the command line wins over the environment. */
    env_name(env, sizeof(env), env_prefix, "config");
    const char *config = getenv(env);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            const char *prog = strrchr(argv[0], '/');
            fprintf(out, "usage: %s [--setting VALUE]...\n\nSettings:\n",
                    prog != NULL ? prog + 1 : argv[0]);
            kvf_config_usage(items, n, env_prefix, out);
            return 1;
        }
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
            config = argv[++i];
        else if (strncmp(argv[i], "--config=", 9) == 0)
            config = argv[i] + 9;
    }
    if (config != NULL && config[0] != '\0') {
        int rc = parse_file(items, n, config, err);
        if (rc != 0)
            return rc;
    }
    for (size_t i = 0; i < n; i++) {
        env_name(env, sizeof(env), env_prefix, items[i].name);
        const char *v = getenv(env);
        if (v != NULL) {
            int rc = set_value(&items[i], v, false, env, err);
            if (rc != 0)
                return rc;
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0)
            return kvf_error_set(err, -EINVAL, "'%s': not a setting (settings start with --)", a);
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq != NULL ? (size_t)(eq - name) : strlen(name);
        if (len == 6 && strncmp(name, "config", 6) == 0) {
            if (eq == NULL)
                i++;
            continue;
        }
        const struct kvf_config_item *it = find(items, n, name, len);
        if (it == NULL)
            return kvf_error_set(err, -EINVAL, "--%.*s: unknown setting (see --help)", (int)len,
                                 name);
        char src[160];
        snprintf(src, sizeof(src), "--%s", it->name);
        const char *val;
        if (eq != NULL)
            val = eq + 1;
        else if (it->kind == KVF_CONFIG_BOOL &&
                 (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0))
            val = "true";
        else if (i + 1 < argc)
            val = argv[++i];
        else
            return kvf_error_set(err, -EINVAL, "%s: needs a value", src);
        int rc = set_value(it, val, false, src, err);
        if (rc != 0)
            return rc;
    }
    return 0;
}
