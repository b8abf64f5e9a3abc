/* `arserve serve`: reads the daemon's settings (flags, environment, config
 * file: server/config.h), finds the model, and runs the daemon
 * (server/daemon.h). */
#include <stdio.h>

#include "cli/cli.h"
#include "server/config.h"
#include "server/daemon.h"

int cmd_serve(int argc, char **argv, char **envp) {
    server_config_t cfg;
    ar_error_t err = {{0}};
    int want_help = 0;
    if (server_config_load(&cfg, argc, argv, envp, &want_help, &err) != AR_OK) {
        fprintf(stderr, "arserve serve: %s\n", err.msg);
        return 2;
    }
    if (want_help) {
        printf("usage: arserve serve [options]\n\n");
        server_config_usage(stdout);
        return 0;
    }
    if (!cfg.model[0] && cli_default_model(cfg.model, sizeof cfg.model))
        return 1;
    return daemon_run(&cfg, ARSERVE_VERSION);
}
