/*
 * src/commands.h — the subcommands. Each takes argv with argv[0] = the subcommand name and
 * returns an enum ng_status (the exit code); errors are recorded with ng_fail, printed by main.
 */
#ifndef NG_SRC_COMMANDS_H
#define NG_SRC_COMMANDS_H

#include "util/status.h"

enum ng_status ng_cmd_train(int argc, char **argv);   /* src/cmd_train.c */
enum ng_status ng_cmd_plan(int argc, char **argv);    /* src/cmd_plan.c */
enum ng_status ng_cmd_dump(int argc, char **argv);    /* src/cmd_plan.c */
enum ng_status ng_cmd_prepare(int argc, char **argv); /* src/cmd_prepare.c */
enum ng_status ng_cmd_sample(int argc, char **argv);  /* src/cmd_infer.c */
enum ng_status ng_cmd_eval(int argc, char **argv);    /* src/cmd_infer.c */

/* main()'s dispatcher, callable from tests: runs `nanograph argv[1] ...`. */
enum ng_status ng_main(int argc, char **argv);

#endif
