package agentconfig

import "flag"

// Flags are the command-line options of an agent that reads a
// configuration file.
type Flags struct {
	// Path is --config, the file to read.
	Path string
	// Check is --check-config: validate the file and exit.
	Check bool
}

// Register adds --config, with default path def and holds saying what the
// file holds, and --check-config to fs.
func (f *Flags) Register(fs *flag.FlagSet, def, holds string) {
	fs.StringVar(&f.Path, "config", def, "configuration file (YAML): "+holds)
	fs.BoolVar(&f.Check, "check-config", false, "validate the configuration file, report every problem with its key, and exit")
}
