/*
 * completion.c: `kvfence completion bash|zsh` (docs/cli.md). The script is
 * written from the command table (cli_commands, cli_global_opts) and the
 * state enums, so a new command or flag completes without touching this
 * file. zsh gets the same function through bashcompinit.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "kvfence/v1/control.pb-c.h"

static int name_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The short state names of `d` in lower case ("opening active ..."). */
static void print_states(FILE *f, const ProtobufCEnumDescriptor *d, const char *prefix)
{
    size_t pl = strlen(prefix);
    for (unsigned i = 0; i < d->n_values; i++) {
        const char *n = d->values[i].name;
        n = strncmp(n, prefix, pl) == 0 ? n + pl : n;
        if (strcmp(n, "UNSPECIFIED") == 0) {
            continue;
        }
        fputc(' ', f);
        for (const char *p = n; *p; p++) {
            fputc(*p >= 'A' && *p <= 'Z' ? *p - 'A' + 'a' : *p, f);
        }
    }
}

static void print_opts(FILE *f, const struct cli_opt *opts)
{
    for (const struct cli_opt *o = opts; o && o->name; o++) {
        fprintf(f, " --%s", o->name);
        if (o->shortc) {
            fprintf(f, " -%c", o->shortc);
        }
    }
}

static void print_bash(FILE *f)
{
    const char *names[64];
    size_t n = cli_command_count < 64 ? cli_command_count : 64;
    for (size_t i = 0; i < n; i++) {
        names[i] = cli_commands[i].name;
    }
    qsort(names, n, sizeof names[0], name_cmp);

    fprintf(f, "# bash completion for kvfence (kvfence completion bash)\n"
               "_kvfence() {\n"
               "    local cur prev cmd i\n"
               "    cur=\"${COMP_WORDS[COMP_CWORD]}\"\n"
               "    prev=\"\"\n"
               "    if ((COMP_CWORD > 0)); then prev=\"${COMP_WORDS[COMP_CWORD-1]}\"; fi\n"
               "    local commands=\"");
    for (size_t i = 0; i < n; i++) {
        fprintf(f, "%s%s", i ? " " : "", names[i]);
    }
    fprintf(f, "\"\n    local globals=\"");
    print_opts(f, cli_global_opts);
    fprintf(f, "\"\n"
               "    cmd=\"\"\n"
               "    for ((i = 1; i < COMP_CWORD; i++)); do\n"
               "        case \"${COMP_WORDS[i]}\" in\n"
               "            ");
    bool first = true;
    for (const struct cli_opt *o = cli_global_opts; o->name; o++) {
        if (!o->has_arg) {
            continue;
        }
        fprintf(f, "%s--%s", first ? "" : "|", o->name);
        if (o->shortc) {
            fprintf(f, "|-%c", o->shortc);
        }
        first = false;
    }
    fprintf(f, ") ((i++)) ;;\n"
               "            -*) ;;\n"
               "            *) cmd=\"${COMP_WORDS[i]}\"; break ;;\n"
               "        esac\n"
               "    done\n"
               "    case \"$prev\" in\n"
               "        -o|--output)\n"
               "            COMPREPLY=($(compgen -W \"table wide json yaml\" -- \"$cur\")); "
               "return ;;\n"
               "        --tls-ca|--tls-cert|--tls-key)\n"
               "            COMPREPLY=($(compgen -f -- \"$cur\")); return ;;\n"
               "        --state)\n"
               "            case \"$cmd\" in\n"
               "                rooms) COMPREPLY=($(compgen -W \"");
    print_states(f, &kvfence__v1__room_state__descriptor, "ROOM_STATE_");
    fprintf(f, "\" -- \"$cur\")) ;;\n"
               "                leases) COMPREPLY=($(compgen -W \"");
    print_states(f, &kvfence__v1__lease_state__descriptor, "LEASE_STATE_");
    fprintf(f, "\" -- \"$cur\")) ;;\n"
               "            esac\n"
               "            return ;;\n"
               "    esac\n"
               "    if [[ -z \"$cmd\" ]]; then\n"
               "        if [[ \"$cur\" == -* ]]; then\n"
               "            COMPREPLY=($(compgen -W \"$globals\" -- \"$cur\"))\n"
               "        else\n"
               "            COMPREPLY=($(compgen -W \"$commands\" -- \"$cur\"))\n"
               "        fi\n"
               "        return\n"
               "    fi\n"
               "    local opts=\"\"\n"
               "    case \"$cmd\" in\n"
               "        help) COMPREPLY=($(compgen -W \"$commands\" -- \"$cur\")); return ;;\n"
               "        completion) COMPREPLY=($(compgen -W \"bash zsh\" -- \"$cur\")); "
               "return ;;\n");
    for (size_t i = 0; i < cli_command_count; i++) {
        const struct cli_command *k = &cli_commands[i];
        if (!k->run || !k->opts || !k->opts->name) {
            continue;
        }
        fprintf(f, "        %s) opts=\"", k->name);
        print_opts(f, k->opts);
        fprintf(f, "\" ;;\n");
    }
    fprintf(f, "    esac\n"
               "    COMPREPLY=($(compgen -W \"$opts $globals\" -- \"$cur\"))\n"
               "}\n"
               "complete -F _kvfence kvfence\n");
}

int cli_completion(const struct cli *c, const char *shell)
{
    if (strcmp(shell, "bash") == 0) {
        print_bash(stdout);
        return EXIT_OK;
    }
    if (strcmp(shell, "zsh") == 0) {
        printf("#compdef kvfence\n"
               "# zsh completion for kvfence (kvfence completion zsh): the bash function\n"
               "# through bashcompinit.\n"
               "autoload -U +X bashcompinit && bashcompinit\n");
        print_bash(stdout);
        return EXIT_OK;
    }
    return cli_usage_error(c, "completion: '%s' is neither bash nor zsh", shell);
}
