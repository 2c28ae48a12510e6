"""The playground page in headless Chromium: load it, send a prompt, watch the answer stream in
and the live statistics line fill, keep a screenshot (target/test-artifacts/playground.png)."""

import os

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from conftest import env


def browser():
    options = webdriver.ChromeOptions()
    # Both paths explicitly: otherwise Selenium Manager tries to download a browser and driver.
    options.binary_location = env("SEQUOIA_CHROMIUM")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1100,900"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=env("SEQUOIA_CHROMEDRIVER")),
                            options=options)


def test_playground_streams_an_answer(base_url, token, expected):
    driver = browser()
    try:
        driver.get(base_url + "/")
        assert "Sequoia playground" in driver.title
        # Record the answer's length at every change: streamed text shows several lengths
        # before the last, text set at once only one.
        driver.execute_script("""
            window.__lengths = new Set();
            new MutationObserver(() => {
              const a = document.querySelector('.msg.assistant');
              if (a && a.textContent.length) window.__lengths.add(a.textContent.length);
            }).observe(document.getElementById('log'),
                       {subtree: true, childList: true, characterData: true});
        """)
        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.ID, "max_tokens").clear()
        driver.find_element(By.ID, "max_tokens").send_keys(str(expected["max_tokens"]))
        driver.find_element(By.ID, "prompt").send_keys(expected["chat_prompt"])
        driver.find_element(By.ID, "send").click()
        wait = WebDriverWait(driver, 300)
        # The final statistics line names drafted and accepted tokens.
        wait.until(lambda d: "drafted" in d.find_element(By.ID, "stats").text)
        wait.until(lambda d: d.find_element(By.ID, "send").is_enabled())
        answer = driver.find_element(By.CSS_SELECTOR, ".msg.assistant").get_attribute("textContent")
        stats = driver.find_element(By.ID, "stats").text
        errors = driver.find_elements(By.CSS_SELECTOR, ".msg.error")
        assert not errors, errors[0].text
        # Temperature 0 (the page's default): the same greedy text as every other front end.
        assert answer == expected["chat_text"]
        assert "tokens/s" in stats and "tokens/step" in stats
        lengths = driver.execute_script("return Array.from(window.__lengths)")
        assert len(lengths) >= 2, f"the answer did not stream: lengths seen {lengths}"
        model = driver.find_element(By.ID, "model").text
        assert model == expected["target_model"]
        shot = os.path.join(env("SEQUOIA_ARTIFACTS"), "playground.png")
        assert driver.save_screenshot(shot)
        print(f"playground: {answer!r}\nstats: {stats}\nscreenshot: {shot}")
    finally:
        driver.quit()
