// Command consoleshots takes the screenshots of docs/console.md from a
// running console (make pictures, scripts/pictures.sh): each page named on
// the command line, loaded in headless Chromium (package browser: loopback
// only), given a moment for its live updates, and captured whole as
// OUT_DIR/console-NAME.png. It fails if a page reports an error or asks
// for anything outside loopback, so a picture never shows a broken page.
//
//	consoleshots -base http://127.0.0.1:8090 -out docs/img fleet=/ pool=/pools/demo events=/events
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/chromedp/chromedp"

	"proxyfleet/e2e/internal/browser"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "consoleshots:", err)
		os.Exit(1)
	}
}

func run() error {
	base := flag.String("base", "http://127.0.0.1:8090", "the console's base URL")
	out := flag.String("out", "docs/img", "directory of the PNG files")
	width := flag.Int("width", 1280, "window width in CSS pixels")
	settle := flag.Duration("settle", 3*time.Second, "how long each page runs its live updates before the capture")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: consoleshots [flags] NAME=PATH...\n\nWrites OUT/console-NAME.png of each console page PATH.\n\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		return errors.New("no page named")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var chromium bytes.Buffer
	b, err := browser.Start(ctx, browser.Options{Width: *width, Height: 800, Output: &chromium})
	if err != nil {
		return fmt.Errorf("%w\n%s", err, chromium.String())
	}
	defer b.Close()
	for _, arg := range flag.Args() {
		name, path, ok := strings.Cut(arg, "=")
		if !ok || name == "" || !strings.HasPrefix(path, "/") {
			return fmt.Errorf("%q: want NAME=/path", arg)
		}
		if err := shoot(b, *base+path, filepath.Join(*out, "console-"+name+".png"), *settle); err != nil {
			return fmt.Errorf("%s (%s): %w", name, path, err)
		}
	}
	return nil
}

// shoot captures one page in a tab of its own.
func shoot(b *browser.Browser, url, file string, settle time.Duration) error {
	tab, cancel := b.NewTab()
	defer cancel()
	problems := browser.WatchProblems(tab)
	if err := chromedp.Do(tab, chromedp.Navigate(url)); err != nil {
		return err
	}
	time.Sleep(settle)
	shot, err := browser.Screenshot(tab)
	if err != nil {
		return err
	}
	if p := problems.List(); len(p) > 0 {
		return fmt.Errorf("the page reported errors: %s", strings.Join(p, "; "))
	}
	if o := problems.Outside(); len(o) > 0 {
		return fmt.Errorf("the page asked for URLs outside loopback: %s", strings.Join(o, " "))
	}
	img, err := png.Decode(bytes.NewReader(shot))
	if err != nil {
		return fmt.Errorf("the screenshot is no PNG: %w", err)
	}
	if err := os.WriteFile(file, shot, 0o644); err != nil {
		return err
	}
	fmt.Printf("wrote %s (%dx%d)\n", file, img.Bounds().Dx(), img.Bounds().Dy())
	return nil
}
