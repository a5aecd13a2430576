/*
 * src/main.c — the nanograph program: dispatch, then print the one recorded error line.
 */
#include "src/commands.h"

int main(int argc, char **argv)
{
	enum ng_status st = ng_main(argc, argv);
	if (st != NG_OK)
		ng_print_error();
	return (int)st;
}
